"""Issue 26 on the GPU (async scheduling, CUDA graphs): the step records count every scheduled
token (prefill + decode), and a profile trace holds both the engine's step phases and CUDA kernels."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MODEL = str(Path(__file__).resolve().parents[2] / "minivllm" / "bench" / "configs" / "qwen3-0.6b")


@pytest.fixture(scope="module")
def llm():
    return LLM(model=MODEL, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
               gpu_memory_utilization=0.35, seed=0)


def _prompts(n: int) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(rng.randint(50, 600))]} for _ in range(n)]


def test_step_records_count_every_token(llm):
    engine = llm.llm_engine
    first = engine.history.next_step
    prompts = _prompts(32)
    llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    recs = engine.history.since(first).records
    # random prompts: no prefix hits, so every prompt token is computed (more only after a preemption)
    assert sum(r.prefill_tokens for r in recs) >= sum(len(p["prompt_token_ids"]) for p in prompts)
    # one decode token per step per request after its prompt: 39 each (the first comes with the
    # prompt); async scheduling may schedule at most one step past the end
    assert 32 * 39 <= sum(r.decode_tokens for r in recs) <= 32 * 40
    assert max(r.num_seqs for r in recs) == 32 and all(r.num_tokens <= r.token_budget for r in recs)


def test_profile_trace_has_kernels_and_phases(llm, tmp_path):
    engine = llm.llm_engine
    engine.profiler.start()
    llm.generate(_prompts(8), SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    path = engine.profiler.stop(str(tmp_path))
    events = json.loads(Path(path).read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # GPU kernels
    names = {e.get("name") for e in events}
    assert {"minivllm.schedule", "minivllm.launch", "minivllm.wait"} <= names
