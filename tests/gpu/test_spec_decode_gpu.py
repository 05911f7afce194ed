"""Speculative decoding on the GPU (CUDA graphs on: verify steps replay the mixed-step graphs),
float32 on the real SmolLM2 weights: every proposer's greedy tokens equal the non-speculative
engine's, and verify steps really ran through graphs."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.models.source import default_gguf_path

pytestmark = pytest.mark.gpu

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
           "polished the great lens and wrote the weather in a leather book.")
MESSAGES = [[{"role": "user", "content": f"Repeat exactly: {PASSAGE}"}],
            [{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "Write a haiku about autumn."}]]
MEDUSA = os.path.join(os.path.dirname(__file__), "..", "data", "medusa-smollm2")
CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6},
    "layer_skip": {"method": "layer_skip", "num_layers": 12, "num_speculative_tokens": 3},
    "draft_model": {"model": "DEFAULT", "num_speculative_tokens": 3},
    "medusa": {"method": "medusa", "model": MEDUSA, "num_speculative_tokens": 3},
}


def _run(spec):
    llm = LLM(device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 30, max_model_len=1024,
              speculative_config=spec)
    out = [o.outputs[0].token_ids for o in llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=48),
                                                     use_tqdm=False)]
    graphs = llm.llm_engine.executor.runner.graphs
    stats = llm.llm_engine.scheduler.spec_stats
    replays = dict(graphs.replays) if graphs is not None else {}
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out, stats, replays


@pytest.fixture(scope="module")
def reference():
    return _run(None)[0]


@pytest.mark.parametrize("method", list(CONFIGS))
def test_gpu_speculative_greedy_equals_plain(reference, method):
    spec = dict(CONFIGS[method])
    if spec.get("model") == "DEFAULT":
        spec["model"] = default_gguf_path()
    out, stats, replays = _run(spec)
    assert out == reference
    assert stats.num_drafts > 0
    assert replays.get("mixed", 0) > 0  # verify steps (1 + k tokens a request) ran as graphs
