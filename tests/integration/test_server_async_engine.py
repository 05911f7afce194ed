"""AsyncEngine: one engine thread serving many asyncio callers (generate, abort from any point,
errors to the caller, idle without spinning, graceful shutdown, a dying engine thread)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from minivllm import SamplingParams
from minivllm.engine.async_engine import AsyncEngine, EngineClosedError, EngineDeadError
from minivllm.engine.llm_engine import LLMEngine

FIXED = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_engine() -> LLMEngine:
    return LLMEngine.from_kwargs(dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_bytes=64 << 20)


@pytest.fixture
def eng(llm_engine):
    e = AsyncEngine(llm_engine, own_engine=False)
    yield e
    e.shutdown()


def _idle(e: AsyncEngine) -> bool:
    s = e.get_stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_kv_blocks


async def _until(pred, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def _collect(e: AsyncEngine, prompt, params, rid: str):
    outs = [o async for o in e.generate(prompt, params, rid)]
    return outs


def test_concurrent_generate_is_cumulative_and_complete(eng, llm_engine):
    prompts = [f"Count to {i}:" for i in range(8)]

    async def main():
        return await asyncio.gather(*(_collect(eng, p, FIXED, f"r{i}") for i, p in enumerate(prompts)))
    results = asyncio.run(main())
    for outs in results:
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert len(outs[-1].outputs[0].token_ids) == 6
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and not any(o.finished for o in outs[:-1])
    # the same prompt alone gives the same greedy tokens
    alone = asyncio.run(_collect(eng, prompts[3], FIXED, "alone"))
    assert alone[-1].outputs[0].token_ids == results[3][-1].outputs[0].token_ids
    assert _idle(eng)


def test_add_request_errors_reach_the_caller(eng):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await eng.add_request("e1", [], FIXED)
        with pytest.raises(ValueError, match="max_model_len"):
            await eng.add_request("e2", [1] * 600, FIXED)
        s = await eng.add_request("dup", "Hello", FIXED)
        with pytest.raises(ValueError, match="already in use"):
            await eng.add_request("dup", "Hello", FIXED)
        return [o async for o in s]
    outs = asyncio.run(main())
    assert outs[-1].outputs[0].finish_reason == "length"  # the refused duplicate did not disturb it


def test_abort_while_waiting_and_while_running_frees_blocks(eng):
    async def main():
        eng.pause()
        waiting = await eng.add_request("w", "Hello there", LONG)
        await _until(lambda: eng.get_stats().num_waiting == 1)
        eng.abort("w")
        eng.resume()
        w = [o async for o in waiting]
        running = await eng.add_request("r", "Hello there", LONG)
        seen = 0
        async for out in running:
            seen += 1
            if seen == 3:
                assert eng.get_stats().num_free_blocks < eng.get_stats().num_kv_blocks
                eng.abort("r")  # from the consumer, mid-decode
            last = out
        await _until(lambda: _idle(eng))
        return w[-1], last
    w, r = asyncio.run(main())
    assert w.finished and w.outputs[0].finish_reason == "abort" and w.outputs[0].token_ids == []
    assert r.finished and r.outputs[0].finish_reason == "abort" and 0 < len(r.outputs[0].token_ids) < 400


def test_abort_from_another_thread_and_by_closing_the_iterator(eng):
    async def main():
        gen = eng.generate("Hello", LONG, "closed")
        async for _ in gen:
            break
        await gen.aclose()  # the consumer went away: the request is aborted
        await _until(lambda: _idle(eng))
        stream = await eng.add_request("threaded", "Hello", LONG)
        await stream.__anext__()
        threading.Thread(target=eng.abort, args=("threaded",)).start()
        outs = [o async for o in stream]
        await _until(lambda: _idle(eng))
        return outs[-1]
    last = asyncio.run(main())
    assert last.outputs[0].finish_reason == "abort"


def test_idle_engine_does_not_spin(eng):
    time.sleep(0.3)
    t0, c0 = time.monotonic(), time.process_time()
    time.sleep(1.5)
    cpu = time.process_time() - c0
    assert cpu < 0.15 * (time.monotonic() - t0), f"idle process used {cpu:.2f} s of CPU"


def test_graceful_shutdown_finishes_short_aborts_long(llm_engine):
    e = AsyncEngine(llm_engine, own_engine=False)

    async def main():
        short = await e.add_request("s", "Hi", FIXED)
        long = await e.add_request("l", "Hi", LONG)
        await long.__anext__()
        stopper = asyncio.get_running_loop().run_in_executor(None, e.shutdown, 3.0)
        s = [o async for o in short]
        rest = [o async for o in long]
        await stopper
        with pytest.raises((EngineClosedError, EngineDeadError)):
            await e.add_request("late", "Hi", FIXED)
        return s[-1], rest[-1]
    s, l_ = asyncio.run(main())
    assert s.outputs[0].finish_reason == "length" and l_.outputs[0].finish_reason == "abort"
    with pytest.raises(EngineDeadError):
        e.check_health()  # shut down: not serving


def test_dead_engine_thread_fails_every_stream(llm_engine, monkeypatch):
    e = AsyncEngine(llm_engine, own_engine=False)

    def boom():
        raise RuntimeError("simulated engine crash")

    async def main():
        e.pause()
        streams = [await e.add_request(f"d{i}", "Hi", LONG) for i in range(3)]
        monkeypatch.setattr(llm_engine, "step", boom)
        e.resume()
        errors = []
        for s in streams:
            with pytest.raises(EngineDeadError) as info:
                async for _ in s:
                    pass
            errors.append(info.value)
        with pytest.raises(EngineDeadError):
            await e.add_request("after", "Hi", FIXED)
        return errors
    errors = asyncio.run(asyncio.wait_for(main(), 30))
    assert all("simulated engine crash" in str(err) for err in errors)
    with pytest.raises(EngineDeadError):
        e.check_health()
