"""Swap preemption and the CPU offload tier on the GPU (async scheduling, CUDA graphs, the copy
engine's own stream and pinned host pools), float32 on the real SmolLM2 weights: greedy tokens
equal an unconstrained engine's, the counters move, and no block leaks in either pool."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
PREFIX = "You are a careful assistant. Answer in full sentences and keep to the facts. " * 6
PROMPTS = [f"{PREFIX}Question {i}: tell me about the number {i * 7}." for i in range(12)]
KW = dict(device="cuda", dtype="float32", max_model_len=1024)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**KW, kv_cache_memory_bytes=1 << 30)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    llm.llm_engine.shutdown()
    return out


def _check(llm, reference, prompts=PROMPTS):
    engine = llm.llm_engine
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert got == reference[:len(prompts)]
    bm, swap = engine.block_manager, engine.scheduler.swap
    assert bm.num_free_blocks == bm.num_blocks
    if swap is not None:
        assert swap.pool.num_free == swap.pool.num_blocks
    return engine.get_stats()


@pytest.mark.parametrize("mode", ["swap", "recompute", None])
def test_preemption_modes_on_cuda(reference, mode):
    llm = LLM(**KW, num_kv_blocks=40, enable_prefix_caching=False, preemption_mode=mode, swap_space=0.5)
    stats = _check(llm, reference)
    assert stats.num_preemptions > 0
    if mode is not None:  # (unset: the cost model recomputes this small model's short prompts on a GPU)
        assert (stats.num_blocks_swapped_out > 0) == (mode == "swap")
    llm.llm_engine.shutdown()


def test_offload_tier_on_cuda(reference):
    llm = LLM(**KW, num_kv_blocks=48, kv_offloading_size=0.5)
    _check(llm, reference, PROMPTS[:1])
    filler = [f"Unrelated text number {i}: " + "lorem ipsum dolor sit amet " * 20 for i in range(4)]
    llm.generate(filler, PARAMS, use_tqdm=False)  # evicts the shared prefix from the device
    stats = _check(llm, reference)
    assert stats.offload_hit_blocks > 0 and stats.offload_stored_blocks > 0
    llm.llm_engine.shutdown()
