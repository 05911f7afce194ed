"""The server's periodic one-line engine status log, as vLLM prints it:

    Engine: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 8 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

from two stats snapshots (EngineStats) LOG_INTERVAL_S apart; nothing is logged while the engine
is idle and was idle at the previous line."""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger("minivllm.engine.status")

LOG_INTERVAL_S = 10.0


def status_line(prev, cur, dt_s: float) -> str | None:
    """The line for the interval between snapshots prev and cur (dt_s apart); None when the
    engine did nothing and holds nothing."""
    prompt = cur.prompt_tokens - prev.prompt_tokens
    gen = cur.generation_tokens - prev.generation_tokens
    if not (prompt or gen or cur.num_running or cur.num_waiting):
        return None
    queries = cur.prefix_cache_queries - prev.prefix_cache_queries
    hits = cur.prefix_cache_hits - prev.prefix_cache_hits
    line = (f"Engine: Avg prompt throughput: {prompt / dt_s:.1f} tokens/s, Avg generation throughput: "
            f"{gen / dt_s:.1f} tokens/s, Running: {cur.num_running} reqs, Waiting: {cur.num_waiting} reqs, "
            f"KV cache usage: {100 * cur.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")
    if cur.num_preemptions > prev.num_preemptions:
        line += f", Preemptions: {cur.num_preemptions - prev.num_preemptions}"
    return line


async def log_status_forever(engine, interval_s: float = LOG_INTERVAL_S) -> None:
    """Runs on the server's event loop until cancelled (reads snapshots only: never waits on a step)."""
    prev, t_prev = engine.get_stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        cur, now = engine.get_stats(), time.monotonic()
        line = status_line(prev, cur, now - t_prev)
        if line is not None:
            logger.info("%s", line)
        prev, t_prev = cur, now
