"""Batch-invariant mode on the GPU (Triton path, CUDA graphs, bf16), the default model (real
weights: dummy weights give near-uniform logits whose bf16 logprobs tie and hide differences).
One prompt's token ids and logprobs are bitwise the same alone, at several positions of a batch
of 16, eager vs CUDA graphs, with chunked prefill and after a prefix-cache hit; without the mode
at least one of those differs (else the checks prove nothing)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from minivllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

rng = random.Random(0)
WORDS = "the river runs past an old mill where bread was baked for the town every morning before dawn".split()
PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. The message is "
          "from someone who lived in the same lighthouse a hundred years ago, and it says") * 4
OTHERS = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 600))) for _ in range(15)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=3, max_tokens=24, logprobs=5, ignore_eos=True)


def _llm(**kw) -> LLM:
    return LLM(device="cuda", dtype="bfloat16", max_model_len=2048, kv_cache_memory_bytes=2 << 30, seed=0, **kw)


def _sig(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in s.items())) for s in c.logprobs)


def _runs(llm: LLM, params: SamplingParams) -> dict[str, tuple]:
    runs = {"alone": _sig(llm.generate([PROMPT], params, use_tqdm=False)[0])}
    for i in (0, 5, 15):
        runs[f"position {i}"] = _sig(llm.generate(OTHERS[:i] + [PROMPT] + OTHERS[i:], params, use_tqdm=False)[i])
    return runs


def _chunked_runs(**kw) -> dict[str, tuple]:
    """PROMPT in 64-token chunks, then again from the prefix cache, then in a batch."""
    llm = _llm(enable_prefix_caching=True, max_num_batched_tokens=64, **kw)
    runs = {"chunked": _sig(llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]),
            "prefix hit": _sig(llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]),
            "hit in a batch": _sig(llm.generate(OTHERS[:7] + [PROMPT] + OTHERS[7:], PARAMS, use_tqdm=False)[7])}
    _free(llm)
    return runs


def _free(llm: LLM) -> None:
    llm.llm_engine.shutdown() if hasattr(llm.llm_engine, "shutdown") else None
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_batch_invariant_bf16_triton_cuda_graphs():
    llm = _llm(batch_invariant=True, enable_prefix_caching=False)
    base = _runs(llm, PARAMS)
    seeded = _runs(llm, SEEDED)
    _free(llm)
    eager = _llm(batch_invariant=True, enable_prefix_caching=False, enforce_eager=True)
    eager_runs = _runs(eager, PARAMS)
    _free(eager)
    chunked = _chunked_runs(batch_invariant=True)
    ref = base["alone"]
    assert len(ref[0]) == 24
    assert len({lp for _, lp in ref[1][0]}) > 1  # real, distinct logprobs (not a degenerate model)
    assert [k for k, v in base.items() if v != ref] == []
    assert [k for k, v in seeded.items() if v != seeded["alone"]] == []
    assert [k for k, v in eager_runs.items() if v != ref] == []  # eager == CUDA graphs
    assert [k for k, v in chunked.items() if v != ref] == []


def test_without_the_mode_something_differs():
    llm = _llm(enable_prefix_caching=False)
    runs = _runs(llm, PARAMS)
    _free(llm)
    eager = _llm(enable_prefix_caching=False, enforce_eager=True)
    runs |= {f"eager {k}": v for k, v in _runs(eager, PARAMS).items()}
    _free(eager)
    runs |= _chunked_runs()
    assert [k for k, v in runs.items() if v != runs["alone"]], "default mode showed no difference"
