"""Tensor and pipeline parallelism through the mp executor (one worker process per rank, gloo
on the CPU, fp32): greedy tokens equal the single-rank engine's token for token, a preempting
batch included; a killed worker fails every request and leaves no process behind.

The tiny random Llama (4 heads, 2 KV heads, 4 layers) covers tp=2, tp=4 (KV heads replicated),
pp=2 and tp=2 x pp=2; tests/integration/test_parallel_default_model.py runs the bundled model."""

from __future__ import annotations

import os
import signal
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.errors import EngineDeadError
from minivllm.server.testing import pid_gone

PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 40)), [100, 200, 300], [7] * 20, list(range(300, 250, -2)), [42]]


def _generate(llm: LLM, max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _llm(path: str, num_kv_blocks: int = 6, **kw) -> LLM:
    # 6 blocks of 16 tokens: the six requests grow to 17 blocks, so some are preempted
    return LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, num_kv_blocks=num_kv_blocks, **kw)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = _llm(tiny_llama())
    tokens = _generate(llm)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    llm.llm_engine.shutdown()
    return tokens


@pytest.mark.parametrize("tp, pp", [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_greedy_tokens_equal_a_single_rank(tiny_llama, reference, tp, pp):
    llm = _llm(tiny_llama(), tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp")
    try:
        assert _generate(llm) == reference
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_kv_blocks == 6
        # every rank froze its startup heap (torch, the model) out of its full GC passes
        assert all(n > 50_000 for n in llm.llm_engine.executor.rank_frozen_objects)
    finally:
        llm.llm_engine.shutdown()
    assert all(pid_gone(pid) for pid in llm.llm_engine.executor.worker_pids)


def test_async_scheduling_through_the_workers(tiny_llama, reference, monkeypatch):
    """The workers' overlap protocol (on by default on a GPU; forced here): a worker finishes its
    step in flight when the next step arrives, launched behind it, or when the engine core asks
    ("finish") because none will come. Tokens equal one rank's, with preemption, and again after
    the engine idled between two calls (a worker waiting for a step that never comes would hang).
    The engine core keeps two steps in flight (engine/llm_engine.steps_ahead), one with
    MINIVLLM_STEPS_AHEAD=1."""
    for ahead in ("2", "1"):
        monkeypatch.setenv("MINIVLLM_STEPS_AHEAD", ahead)
        llm = _llm(tiny_llama(), tensor_parallel_size=2, distributed_executor_backend="mp", async_scheduling=True)
        try:
            assert llm.llm_engine.config.async_scheduling
            assert _generate(llm) == reference
            assert _generate(llm) == reference
            assert llm.llm_engine.get_stats().num_preemptions > 0
            assert (llm.llm_engine.num_steps_ahead > 0) == (ahead == "2")
        finally:
            llm.llm_engine.shutdown()


def test_a_killed_worker_fails_every_request_and_leaves_nothing_behind(tiny_llama):
    llm = _llm(tiny_llama(), tensor_parallel_size=2, num_kv_blocks=64)
    engine = llm.llm_engine
    pids = engine.executor.worker_pids
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outputs = []
    for _ in range(3):
        outputs += engine.step()
    assert not any(o.finished for o in outputs)
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        outputs += engine.step()
    finished = {o.request_id: o.outputs[0].finish_reason for o in outputs if o.finished}
    assert finished == {str(i): "error" for i in range(len(PROMPTS))}
    assert "rank 1" in str(engine.dead_error)
    with pytest.raises(EngineDeadError):
        engine.add_request("late", {"prompt_token_ids": [1, 2]}, params)
    assert all(pid_gone(pid) for pid in pids)  # the other rank is stopped too
    engine.shutdown()
