"""The server's periodic one-line engine status log, as vLLM prints it:

    Engine: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 8 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

from two stats snapshots (EngineStats) LOG_INTERVAL_S apart; nothing is logged while the engine
is idle and was idle at the previous line. Under data parallelism (-dp N) the line is the sum and
one more line follows per busy replica, named as vLLM names its engines (`Engine 001: ...`);
under multi-model serve each model logs its own lines, named (`Engine [small]: ...`).
"""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger("minivllm.engine.status")

LOG_INTERVAL_S = 10.0


def status_lines(prev, cur, dt_s: float, model: str | None = None) -> list[str]:
    """The lines for the interval between snapshots prev and cur (dt_s apart): the engine's,
    then each busy data-parallel replica's; none when the engine did nothing and holds nothing."""
    suffix = f" [{model}]" if model else ""
    line = status_line(prev, cur, dt_s, "Engine" + suffix)
    if line is None:
        return []
    lines = [line]
    if len(cur.replicas) > 1 and len(prev.replicas) == len(cur.replicas):
        for i, (p, c) in enumerate(zip(prev.replicas, cur.replicas)):
            replica_line = status_line(p, c, dt_s, f"Engine {i:03d}{suffix}")
            if replica_line is not None:
                lines.append(replica_line)
    return lines


def status_line(prev, cur, dt_s: float, label: str = "Engine") -> str | None:
    """One engine's line (label: its name) for the interval between snapshots prev and cur
    (dt_s apart); None when the engine did nothing and holds nothing."""
    prompt = cur.prompt_tokens - prev.prompt_tokens
    gen = cur.generation_tokens - prev.generation_tokens
    if not (prompt or gen or cur.num_running or cur.num_waiting):
        return None
    queries = cur.prefix_cache_queries - prev.prefix_cache_queries
    hits = cur.prefix_cache_hits - prev.prefix_cache_hits
    line = (f"{label}: Avg prompt throughput: {prompt / dt_s:.1f} tokens/s, Avg generation throughput: "
            f"{gen / dt_s:.1f} tokens/s, Running: {cur.num_running} reqs, Waiting: {cur.num_waiting} reqs, "
            f"KV cache usage: {100 * cur.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")
    if cur.num_preemptions > prev.num_preemptions:
        line += f", Preemptions: {cur.num_preemptions - prev.num_preemptions}"
    return line


async def log_status_forever(engine, interval_s: float = LOG_INTERVAL_S, model: str | None = None) -> None:
    """Runs on the server's event loop until cancelled (reads snapshots only: never waits on a
    step). model: the model's name in every line (multi-model serve), or None."""
    prev, t_prev = engine.get_stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        cur, now = engine.get_stats(), time.monotonic()
        for line in status_lines(prev, cur, now - t_prev, model):
            logger.info("%s", line)
        prev, t_prev = cur, now


def show_status_lines() -> None:
    """The status lines print at INFO whatever --log-level says (its default, WARNING, would hide
    them; --disable-log-stats is the way to turn them off, as in vLLM)."""
    logger.setLevel(logging.INFO)


def start_status_log(state, model: str | None = None) -> asyncio.Task | None:
    """The status log task of one app's engine (server/app.py's ServerState), on the running
    event loop; None when its settings turn the log off."""
    interval_s = state.settings.status_log_interval_s
    if not interval_s:
        return None
    return asyncio.create_task(log_status_forever(state.engine, interval_s, model))
