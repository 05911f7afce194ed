"""GET /load and the dashboard's routes on a real server (the default model on the CPU), with
the engine in this process and in its own process."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from minivllm.server.app import create_app
from minivllm.server.serving_common import ServerSettings
from minivllm.server.testing import ServerThread, wait_until

KW = dict(dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
PROMPT_LEN, MAX_TOKENS, N = 40, 300, 5
KEY = "sk-dash"


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request):
    if request.param == "thread":
        from minivllm.engine.async_engine import AsyncEngine
        engine = AsyncEngine.from_kwargs(**KW)
    else:
        from minivllm.engine.mp_async_engine import MPAsyncEngine
        engine = MPAsyncEngine.from_kwargs(**KW)
    with ServerThread(create_app(engine, ServerSettings(api_key=KEY, dashboard_interval_s=0.2))) as srv:
        yield engine, srv.base_url


def _until(pred, timeout_s: float = 30.0, what: str = "condition"):
    return wait_until(pred, timeout_s, what, poll_s=0.05)


def _stream_in_background(base: str, i: int, stop: threading.Event) -> threading.Thread:
    body = {"model": None, "prompt": [100 + i] * PROMPT_LEN, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True}
    body.pop("model")

    def run():
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # closing the stream aborts the request
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _load(base: str) -> dict:
    r = httpx.get(base + "/load")  # open, like /metrics: a router polls it
    assert r.status_code == 200
    return r.json()


def test_load_reflects_n_sleeping_requests_exactly(server):
    engine, base = server
    assert _load(base)["num_requests_waiting"] == 0
    engine.pause()  # the requests sleep in the queue
    stop = threading.Event()
    threads = [_stream_in_background(base, i, stop) for i in range(N)]
    try:
        load = _until(lambda: (lambda d: d if d["num_requests_waiting"] == N else None)(_load(base)),
                      what=f"{N} waiting requests")
        assert load["num_requests_running"] == 0
        assert load["tokens_in_flight"] == N * (PROMPT_LEN + MAX_TOKENS)
        assert load["kv_cache_usage"] == 0.0 and load["num_free_kv_blocks"] == load["num_kv_blocks"]
        assert load["estimated_queue_delay_s"] is None or load["estimated_queue_delay_s"] > 0
        engine.resume()
        load = _until(lambda: (lambda d: d if d["num_requests_running"] == N else None)(_load(base)),
                      what=f"{N} running requests")
        assert load["num_requests_waiting"] == 0 and load["estimated_queue_delay_s"] == 0.0
        blocks_each = -(-PROMPT_LEN // 16)
        assert load["num_kv_blocks"] - load["num_free_kv_blocks"] >= N * blocks_each
    finally:
        engine.resume()
        stop.set()
        for t in threads:
            t.join(60)
    load = _until(lambda: (lambda d: d if d["tokens_in_flight"] == 0 else None)(_load(base)), what="idle")
    assert load["num_requests_running"] == 0 and load["num_free_kv_blocks"] == load["num_kv_blocks"]


def _holds_blocks(event: dict) -> bool:
    m = event["block_map"]
    return m is not None and any(c >= 2 for c in m["cells"])


def _events(base: str, done, timeout_s: float = 90.0) -> list[dict]:
    """Events of /dashboard/events until done(events) (at least three), or the timeout."""
    out, deadline = [], time.monotonic() + timeout_s
    with httpx.stream("GET", base + f"/dashboard/events?api_key={KEY}", timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if (len(out) >= 3 and done(out)) or time.monotonic() > deadline:
                    return out
    return out


def test_dashboard_events_carry_steps_batch_and_block_map(server):
    _, base = server
    page = httpx.get(base + f"/dashboard?api_key={KEY}")
    assert page.status_code == 200 and "EventSource" in page.text and "kv-map" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # self-contained: nothing fetched
    stop = threading.Event()
    threads = [_stream_in_background(base, i, stop) for i in range(3)]
    try:
        events = _events(base, lambda ev: any(_holds_blocks(e) for e in ev)
                         and any(s["decode_tokens"] > 0 for e in ev for s in e["steps"]))
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    steps = [s for e in events for s in e["steps"]]
    assert steps, "no step records reached the dashboard"
    assert [s["step"] for s in steps] == sorted({s["step"] for s in steps})  # each step once, in order
    assert any(s["decode_tokens"] > 0 for s in steps)
    assert all(s["num_tokens"] == s["prefill_tokens"] + s["decode_tokens"] for s in steps)
    assert any(len(e["batch"]) >= 1 for e in events)
    assert any(_holds_blocks(e) for e in events), "no KV block map with blocks held by requests"
    assert events[-1]["models"] and "num_requests_running" in events[-1]["load"]


def test_dashboard_needs_the_key_and_can_be_off(server):
    engine, base = server
    assert httpx.get(base + "/dashboard").status_code == 401
    assert httpx.get(base + "/dashboard?api_key=wrong").status_code == 401
    assert httpx.get(base + "/dashboard/events").status_code == 401
    assert httpx.get(base + "/dashboard", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    app = create_app(engine, ServerSettings(enable_dashboard=False, own_engine=False))
    with ServerThread(app) as srv:
        assert httpx.get(srv.base_url + "/dashboard").status_code == 404
        assert httpx.get(srv.base_url + "/load").status_code == 200


def test_start_and_stop_profile_write_a_chrome_trace(server, tmp_path):
    engine, _ = server
    settings = ServerSettings(own_engine=False, profile_dir=str(tmp_path), status_log_interval_s=None)
    with ServerThread(create_app(engine, settings)) as srv:
        assert httpx.post(srv.base_url + "/start_profile").status_code == 200
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": [5] * 20, "max_tokens": 4}, timeout=120)
        assert r.status_code == 200
        assert httpx.post(srv.base_url + "/stop_profile").status_code == 200
        (trace,) = _until(lambda: list(tmp_path.glob("engine-*.pt.trace.json")), what="the trace file")
        names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
        assert {"minivllm.schedule", "minivllm.launch"} <= names and any(str(n).startswith("aten::") for n in names)
    app = create_app(engine, ServerSettings(own_engine=False))  # without --profile-dir: no such routes
    with ServerThread(app) as srv:
        assert httpx.post(srv.base_url + "/start_profile").status_code == 404
