"""GET /load (a router's view of this server at the instant) and the live dashboard: GET
/dashboard (one self-contained HTML page, static/dashboard.html) fed by Server-Sent Events from
GET /dashboard/events.

Everything comes from snapshots the engine side already keeps: the stats (get_stats), the step
history (engine/step_history.py: per-step records, the latest batch, the KV block map) and the
per-second latencies of ServerMetrics (live_stats.py). No route here waits on the engine.

Under data parallelism (-dp N) the view is merged: the step records are the replicas' rounds
with every count summed, the batch and the KV block map join the replicas' (replica 0's blocks
first), and `load.replicas` breaks the counts down per replica (engine/dp_engine.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources

from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

BLOCK_MAP_INTERVAL_S = 1.0  # how often the engine takes the KV block map once a dashboard is open
MAX_STEPS_PER_EVENT = 2000  # records in one event (the first one sends the recent past)


def load_report(state) -> dict:
    """The instant's load: counts from the engine's stats snapshot, and the queueing delay a new
    request can expect, by Little's law: the waiting requests / the recent completion rate
    (None while nothing has finished in the last 10 s and some wait; 0 when none wait). Under
    data parallelism the counts are the replicas' sums and `replicas` has each one's (else [])."""
    stats, now = state.engine.get_stats(), time.time()
    rate = state.metrics.recent.finished_rate(now)
    if stats.num_waiting == 0:
        delay = 0.0
    else:
        delay = stats.num_waiting / rate if rate > 0 else None
    return {"num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting,
            "tokens_in_flight": stats.tokens_in_flight, "kv_cache_usage": stats.kv_cache_usage,
            "num_kv_blocks": stats.num_kv_blocks, "num_free_kv_blocks": stats.num_free_blocks,
            "finished_per_s": rate, "estimated_queue_delay_s": delay, "num_preemptions": stats.num_preemptions,
            "is_accepting": state.engine.is_accepting, "timestamp": now, **_kv_transfer_load(state, stats),
            "replicas": [replica_load(i, r) for i, r in enumerate(stats.replicas)]}


def replica_load(index: int, stats) -> dict:
    """One data-parallel replica's part of the load (-dp N: the counts above are their sums)."""
    q = stats.prefix_cache_queries
    return {"replica": index, "num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage, "num_kv_blocks": stats.num_kv_blocks,
            "num_free_kv_blocks": stats.num_free_blocks, "num_preemptions": stats.num_preemptions,
            "prompt_tokens": stats.prompt_tokens, "generation_tokens": stats.generation_tokens,
            "prefix_cache_hit_rate": stats.prefix_cache_hits / q if q else None}


def _kv_transfer_load(state, stats) -> dict:
    """Disaggregated prefill/decode: the instance's kv_role (None: an ordinary instance; `minivllm
    router` checks it at startup), pulls given up and requests whose blocks wait for a pull."""
    kv = state.engine.config.kv_transfer
    return {"kv_role": kv.kv_role if kv is not None else None, "kv_pulled_blocks": stats.kv_pulled_blocks,
            "kv_pull_failures": stats.kv_pull_failures, "kv_held_requests": stats.kv_held_requests}


def dashboard_event(state, next_step: int, since_s: float) -> tuple[dict, int]:
    """One update: the step records from next_step on, the latest batch and block map, the
    latency series from since_s on, the load and the totals. Returns (event, next step)."""
    snap = state.engine.history.since(next_step, limit=MAX_STEPS_PER_EVENT)
    stats = state.engine.get_stats()
    event = {"models": state.base.model_names, "load": load_report(state),
             "all_models": getattr(state, "all_model_names", state.base.model_names),  # several: multi-model serve
             "steps": [r.to_dict() for r in snap.records], "batch": snap.last_batch,
             "block_map": snap.block_map.to_dict() if snap.block_map is not None else None,
             "latency": state.metrics.recent.series(since_s),
             "totals": {"prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits,
                        "spec_num_draft_tokens": stats.spec_num_draft_tokens,
                        "spec_num_accepted_tokens": stats.spec_num_accepted_tokens,
                        "generation_tokens": stats.generation_tokens, "prompt_tokens": stats.prompt_tokens,
                        "num_preemptions": stats.num_preemptions,
                        "expert_token_counts": stats.expert_token_counts}}
    return event, (snap.records[-1].step + 1 if snap.records else next_step)


async def _events(state, request: Request):
    next_step, interval = 0, state.settings.dashboard_interval_s
    while not await request.is_disconnected():
        since_s = int(time.time()) - 2  # the last seconds' bins again: they fill while they are current
        event, next_step = dashboard_event(state, next_step, since_s if next_step else 0)
        yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        await asyncio.sleep(interval)


def load_router() -> APIRouter:
    r = APIRouter()

    @r.get("/load")
    async def load(request: Request) -> Response:
        return JSONResponse(load_report(request.app.state.minivllm))

    return r


def profile_router() -> APIRouter:
    """vLLM's profiler routes (present only with --profile-dir): the engine starts or stops a
    torch-profiler trace between two steps; the trace appears in the directory once written."""
    r = APIRouter()

    @r.post("/start_profile")
    async def start_profile(request: Request) -> Response:
        request.app.state.minivllm.engine.profile("start")
        return Response(status_code=200)

    @r.post("/stop_profile")
    async def stop_profile(request: Request) -> Response:
        state = request.app.state.minivllm
        state.engine.profile("stop", state.settings.profile_dir)
        return Response(status_code=200)

    return r


def dashboard_router() -> APIRouter:
    """With --api-key the page and its events take the key as `?api_key=` (a browser's page load
    and EventSource send no Authorization header); see ApiKeyMiddleware."""
    r = APIRouter()

    @r.get("/dashboard", response_class=HTMLResponse)
    async def dashboard(request: Request) -> Response:
        state = request.app.state.minivllm
        state.engine.set_block_map_interval(BLOCK_MAP_INTERVAL_S)  # someone is looking: take the KV map
        page = resources.files("minivllm.server").joinpath("static/dashboard.html").read_text()
        return HTMLResponse(page)

    @r.get("/dashboard/events")
    async def events(request: Request) -> Response:
        state = request.app.state.minivllm
        state.engine.set_block_map_interval(BLOCK_MAP_INTERVAL_S)
        return StreamingResponse(_events(state, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return r
