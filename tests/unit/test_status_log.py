"""The server's periodic engine status line (vLLM's format) from two stats snapshots."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from minivllm.engine.llm_engine import EngineStats
from minivllm.server.status_log import log_status_forever, status_line, status_lines

IDLE = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_kv_blocks=100, num_free_blocks=100,
                   prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, prompt_tokens=0,
                   generation_tokens=0)


def test_line_has_throughputs_counts_kv_and_hit_rate():
    cur = dataclasses.replace(IDLE, num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=200,
                              prefix_cache_hits=50, prompt_tokens=1000, generation_tokens=40, num_preemptions=1)
    line = status_line(IDLE, cur, 10.0)
    assert line == ("Engine: Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 4.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%, "
                    "Preemptions: 1")
    assert status_line(cur, cur, 10.0).startswith("Engine: Avg prompt throughput: 0.0 tokens/s")  # still running
    assert status_line(IDLE, IDLE, 10.0) is None  # idle: nothing to say


class _FakeEngine:
    def __init__(self) -> None:
        self.stats = [IDLE, dataclasses.replace(IDLE, generation_tokens=5, num_running=1)]

    def get_stats(self) -> EngineStats:
        return self.stats.pop(0) if len(self.stats) > 1 else self.stats[0]


def test_logs_periodically(caplog):
    async def main():
        task = asyncio.create_task(log_status_forever(_FakeEngine(), 0.01))
        await asyncio.sleep(0.1)
        task.cancel()
    with caplog.at_level(logging.INFO, logger="minivllm.engine.status"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "minivllm.engine.status"]
    assert lines and "Running: 1 reqs" in lines[0] and "Avg generation throughput:" in lines[0]


def test_data_parallel_lines_follow_the_sum_one_per_busy_replica():
    busy = dataclasses.replace(IDLE, num_running=2, generation_tokens=30, kv_cache_usage=0.5)
    prev = dataclasses.replace(IDLE, replicas=(IDLE, IDLE, IDLE))
    cur = dataclasses.replace(busy, replicas=(busy, IDLE, dataclasses.replace(busy, num_running=1)))
    lines = status_lines(prev, cur, 10.0)
    assert [ln.split(":")[0] for ln in lines] == ["Engine", "Engine 000", "Engine 002"]  # replica 1 idle: no line
    assert "Running: 1 reqs" in lines[2] and "Avg generation throughput: 3.0 tokens/s" in lines[1]
    assert status_lines(prev, prev, 10.0) == []


def test_each_models_lines_name_it():
    cur = dataclasses.replace(IDLE, num_waiting=1, replicas=(dataclasses.replace(IDLE, num_waiting=1), IDLE))
    lines = status_lines(dataclasses.replace(IDLE, replicas=(IDLE, IDLE)), cur, 1.0, model="small")
    assert [ln.split(":")[0] for ln in lines] == ["Engine [small]", "Engine 000 [small]"]
