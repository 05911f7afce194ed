"""The engine core in its own process (MPAsyncEngine): what only that mode can get wrong —
the child dying, startup errors crossing the process boundary, drain and shutdown, and the
delta-to-cumulative folding. (Serving behaviour is covered for both modes by
test_server_openai.py.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from minivllm import SamplingParams
from minivllm.engine.async_engine import EngineClosedError, EngineDeadError
from minivllm.engine.engine_core_proc import merge_outputs, pack_output
from minivllm.engine.mp_async_engine import MPAsyncEngine, _fold, _snapshot
from minivllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

KW = dict(dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_bytes=64 << 20)
LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


def _delta(finished: bool, samples: list[tuple[int, str, list[int]]], logprobs: bool = False) -> RequestOutput:
    outs = [CompletionOutput(i, text, ids, -1.0 if logprobs else None,
                             [{t: Logprob(-1.0, 1, None)} for t in ids] if logprobs else None,
                             "length" if finished else None) for i, text, ids in samples]
    return RequestOutput("r", None, [1, 2], outs, finished, metrics=RequestMetrics(10.0, 10.5, 11.0, 12.0))


def test_fold_rebuilds_cumulative_snapshots():
    acc = RequestOutput("r", "hi", [1, 2], [], False)
    _fold(acc, pack_output(_delta(False, [(0, "Hel", [5]), (1, "A", [7])], logprobs=True)))
    first = _snapshot(acc)
    _fold(acc, pack_output(_delta(True, [(0, "lo", [6, 8]), (1, "", [])], logprobs=True)))
    second = _snapshot(acc)
    assert [o.text for o in second.outputs] == ["Hello", "A"]
    assert [o.token_ids for o in second.outputs] == [[5, 6, 8], [7]]
    assert [len(o.logprobs) for o in second.outputs] == [3, 1]
    assert second.finished and second.outputs[0].finish_reason == "length"
    assert second.metrics.first_token_time == 11.0 and second.prompt == "hi"
    # earlier snapshots are independent: folding later steps did not change them
    assert first.outputs[0].token_ids == [5] and first.outputs[0].text == "Hel" and not first.finished


def test_outbox_merges_only_adjacent_step_outputs():
    """Queued "out" messages merge in step order; an "added" ack keeps its place between them
    (a request's outputs must never overtake its acknowledgement)."""
    msgs = [("out", ["a1"], 1), ("out", ["b1", "a2"], 2), ("added", [("c", None)], 3),
            ("out", ["c1"], 4), ("out", ["a3"], 5), ("exited",)]
    assert merge_outputs(msgs) == [("out", ["a1", "b1", "a2"], 2), ("added", [("c", None)], 3),
                                   ("out", ["c1", "a3"], 5), ("exited",)]


def test_startup_error_reaches_the_caller():
    with pytest.raises(ValueError, match="KV cache budget"):
        MPAsyncEngine.from_kwargs(**{**KW, "kv_cache_memory_bytes": 1000})


def test_a_cpu_kv_cache_larger_than_the_host_memory_is_a_clear_error():
    """Not the out-of-memory killer's silent SIGKILL mid-allocation (a 16 GiB CPU cache beside
    another instance did that to the disaggregated plumbing check): the field and the limit."""
    import psutil
    too_big = psutil.virtual_memory().total * 2
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes \(.*\) must fit in the host memory available"):
        MPAsyncEngine.from_kwargs(**{**KW, "kv_cache_memory_bytes": too_big})


def test_a_startup_death_without_a_word_names_the_likely_cause():
    from minivllm.engine.mp_async_engine import startup_exit_message
    assert "out-of-memory" in startup_exit_message(-9)
    assert startup_exit_message(1) == "the engine-core process exited during startup (exit code 1)"


async def _first_output(eng: MPAsyncEngine, rid: str):
    stream = await eng.add_request(rid, "Count to one thousand:", LONG)
    first = await asyncio.wait_for(stream.__anext__(), 120)
    return stream, first


def test_killed_engine_core_fails_streams_and_health():
    eng = MPAsyncEngine.from_kwargs(**KW)
    try:
        async def main():
            stream, first = await _first_output(eng, "a")
            assert not first.finished and first.outputs[0].token_ids
            eng._proc.kill()  # the engine core crashes mid-request
            with pytest.raises(EngineDeadError):
                async for _ in stream:  # must end with an error, not hang
                    pass
            with pytest.raises(EngineDeadError):
                await eng.add_request("b", "Hello", SamplingParams(max_tokens=2))

        asyncio.run(asyncio.wait_for(main(), 180))
        with pytest.raises(EngineDeadError):
            eng.check_health()
    finally:
        eng.shutdown(0.0, join_timeout_s=5)


def test_shutdown_aborts_after_grace_and_exits_cleanly():
    eng = MPAsyncEngine.from_kwargs(**KW)

    async def main():
        stream, _ = await _first_output(eng, "long")
        eng.begin_drain(0.5)  # the request would need far longer than 0.5 s
        with pytest.raises(EngineClosedError):
            await eng.add_request("late", "Hello", SamplingParams(max_tokens=2))
        t0 = time.monotonic()
        last = None
        async for out in stream:
            last = out
        return last, time.monotonic() - t0

    last, waited = asyncio.run(asyncio.wait_for(main(), 180))
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert 0 < len(last.outputs[0].token_ids) < LONG.max_tokens and waited < 60
    stats = eng.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks  # the abort freed every block
    eng.shutdown(0.0)
    assert eng._proc.exitcode == 0
    with pytest.raises(EngineDeadError):
        eng.check_health()
