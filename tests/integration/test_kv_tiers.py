"""Swap preemption and the CPU offload tier on the real model (fp32, CPU): greedy outputs equal an
unconstrained run's, the swap and offload counters move, and no block leaks in either pool.
The engines share one loaded model (LLMEngine(config, model=...)), one after the other."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.config_builder import build_engine_config
from minivllm.engine.llm_engine import LLMEngine

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["Tell me a long story about a cat who lives in a box.",
           "Explain, step by step, how a bicycle stays upright when it moves.",
           "Write a short poem about the sea at night and the lights of the ships.",
           "List some fruits."]
PREFIX = "You are a careful assistant. Answer in full sentences and keep to the facts. " * 4


@pytest.fixture(scope="module")
def base():
    return LLM(dtype="float32", device="cpu", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def reference(base):
    shared = [PREFIX + p for p in PROMPTS]
    outs = base.generate(PROMPTS + shared, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _engine(base, **kwargs) -> LLM:
    """An LLM on the base's loaded model (which then must not run: its KV cache is replaced)."""
    llm = LLM.__new__(LLM)
    config = build_engine_config(dtype="float32", device="cpu", **kwargs)
    llm.llm_engine = LLMEngine(config, model=base.llm_engine.executor.runner.model)
    return llm


def _tokens(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def _assert_no_leak(engine) -> None:
    bm, swap = engine.block_manager, engine.scheduler.swap
    assert bm.num_free_blocks == bm.num_blocks
    if swap is not None:
        assert swap.pool.num_free == swap.pool.num_blocks and not swap.swapped
    if bm.offload is not None:
        assert bm.offload.pool.num_free + len(bm.offload.blocks) == bm.offload.pool.num_blocks


@pytest.mark.parametrize("mode,async_sched", [("swap", False), ("recompute", False), (None, False), ("swap", True)])
def test_preemption_modes_equal_an_unconstrained_run(base, reference, mode, async_sched):
    llm = _engine(base, num_kv_blocks=9, enable_prefix_caching=False, preemption_mode=mode, swap_space=0.05,
                  async_scheduling=async_sched)
    engine = llm.llm_engine
    assert _tokens(llm, PROMPTS) == reference[:len(PROMPTS)]
    stats = engine.get_stats()
    assert stats.num_preemptions > 0, "the KV cache was meant to preempt"
    if mode == "recompute":
        assert stats.num_blocks_swapped_out == 0
    else:  # unset: the cost model swaps (recomputing tens of tokens costs far more than copying blocks)
        assert stats.num_blocks_swapped_out > 0 and stats.num_blocks_swapped_in == stats.num_blocks_swapped_out
        assert stats.kv_transfer_bytes == 2 * stats.num_blocks_swapped_out * engine.host_kv.block_bytes
    _assert_no_leak(engine)


def test_offloaded_prefix_is_loaded_back_and_outputs_match(base, reference):
    llm = _engine(base, num_kv_blocks=14, enable_prefix_caching=True, kv_offloading_size=0.05)
    engine = llm.llm_engine
    shared = [PREFIX + p for p in PROMPTS]
    first = _tokens(llm, shared[:1])
    _tokens(llm, PROMPTS)  # other prompts evict the shared prefix from the device
    stats = engine.get_stats()
    assert stats.offload_stored_blocks > 0 and stats.offload_hit_blocks == 0
    again = _tokens(llm, shared)
    stats = engine.get_stats()
    assert stats.offload_hit_blocks > 0, "the prefix was meant to come back from host memory"
    assert stats.kv_transfer_bytes == (stats.offload_hit_blocks + stats.offload_stored_blocks) * \
        engine.host_kv.block_bytes
    assert first + again == reference[len(PROMPTS):len(PROMPTS) + 1] + reference[len(PROMPTS):]
    _assert_no_leak(engine)
    from minivllm.server.metrics import _EngineStatsCollector  # /metrics reads the same stats
    scraped = {m.name: m.samples[0].value for m in _EngineStatsCollector(engine, "m").collect() if m.samples}
    assert scraped["vllm:kv_offload_hits"] == stats.offload_hit_blocks > 0
    assert scraped["vllm:kv_transfer_bytes"] == stats.kv_transfer_bytes


def test_host_memory_options_are_checked():
    with pytest.raises(ValueError, match="swap_space \\+ kv_offloading_size"):
        build_engine_config(device="cpu", swap_space=1 << 20)
    with pytest.raises(ValueError, match="preemption_mode"):
        build_engine_config(device="cpu", preemption_mode="drop")
    with pytest.raises(ValueError, match="kv_offloading_size"):
        build_engine_config(device="cpu", kv_offloading_size=-1)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        build_engine_config(device="cpu", kv_offloading_size=0.01, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="swap_space must be > 0"):
        build_engine_config(device="cpu", preemption_mode="swap", swap_space=0)
