"""`minivllm serve` as a real process (the default model on the CPU) under data parallelism
(-dp 2) and multi-model serve: the dashboard's merged view and per-replica breakdown, and the
periodic engine status log (one line per replica, per model), read from the server's own log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from minivllm.models.source import default_gguf_path
from minivllm.server.testing import free_port, spawn_server, wait_until

COMMON = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20), "--dtype", "float32",
          "--device", "cpu", "--max-num-seqs", "4"]
PROMPT_LEN, MAX_TOKENS = 40, 200


def _serve(log: Path, *args: str):
    """Starts `minivllm serve ARGS` (status line every 0.5 s) logging to `log`; (process, base URL)."""
    port = free_port()
    env = {**os.environ, "VLLM_LOG_STATS_INTERVAL": "0.5"}
    cmd = [sys.executable, "-m", "minivllm", "serve", "--port", str(port), *COMMON, *args]
    base = f"http://127.0.0.1:{port}"
    return spawn_server(cmd, base, 600, log=log, env=env), base


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stream(base: str, body: dict, stop: threading.Event) -> threading.Thread:
    def run():
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # closing the stream aborts the request
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _status_lines(log: Path, label: str) -> list[str]:
    """The log's status lines whose engine label is exactly `label` (e.g. 'Engine 001')."""
    pattern = re.compile(rf"{re.escape(label)}: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: "
                         r"[\d.]+ tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, "
                         r"Prefix cache hit rate: [\d.]+%")
    return [ln for ln in log.read_text().splitlines() if pattern.search(ln)]


def _until(pred, timeout_s: float = 120.0, what: str = "condition"):
    return wait_until(pred, timeout_s, what, poll_s=0.2)


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("dp") / "serve.log"
    proc, base = _serve(log, "-dp", "2")
    try:
        yield base, log
    finally:
        _stop(proc)


def _both_replicas_busy(event: dict) -> bool:
    reps = event["load"]["replicas"]
    return len(reps) == 2 and all(r["num_requests_running"] == 1 for r in reps) and \
        event["block_map"] is not None and len(event["block_map"]["legend"]) == 2


def test_dashboard_merges_both_replicas_and_breaks_them_down(dp_server):
    base, _ = dp_server
    page = httpx.get(base + "/dashboard")
    assert page.status_code == 200 and "replicas-table" in page.text
    stop = threading.Event()
    # two requests: the least loaded replica takes each, so each replica runs one
    bodies = [{"prompt": [100 + i] * PROMPT_LEN, "max_tokens": MAX_TOKENS, "ignore_eos": True} for i in range(2)]
    threads = [_stream(base, b, stop) for b in bodies]
    events = []
    try:
        with httpx.stream("GET", base + "/dashboard/events", timeout=120) as r:
            assert r.status_code == 200
            deadline = time.monotonic() + 180
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if _both_replicas_busy(events[-1]) or time.monotonic() > deadline:
                        break
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    busy = events[-1]
    assert _both_replicas_busy(busy), busy["load"]
    load, reps = busy["load"], busy["load"]["replicas"]
    assert [r["replica"] for r in reps] == [0, 1]
    for key in ("num_requests_running", "num_requests_waiting", "num_kv_blocks", "num_free_kv_blocks"):
        assert load[key] == sum(r[key] for r in reps), key  # the merged counts are the replicas' sums
    assert load["num_requests_running"] == 2
    # the merged block map: both replicas' blocks side by side, one request holding blocks in each half
    m = busy["block_map"]
    assert m["num_blocks"] == load["num_kv_blocks"]
    half = len(m["cells"]) // 2
    assert {c for c in m["cells"][:half] if c >= 2} and {c for c in m["cells"][half:] if c >= 2}
    assert not {c for c in m["cells"][:half] if c >= 2} & {c for c in m["cells"][half:] if c >= 2}
    steps = [s for e in events for s in e["steps"]]
    assert [s["step"] for s in steps] == sorted({s["step"] for s in steps})  # merged rounds, each once
    assert all(s["num_blocks"] == load["num_kv_blocks"] for s in steps)
    assert any(s["num_seqs"] == 2 and s["num_running"] == 2 for s in steps), "no round with both replicas' requests"
    assert all(s["num_tokens"] == s["prefill_tokens"] + s["decode_tokens"] for s in steps)
    assert any(len(e["batch"]) == 2 for e in events)  # the batch joins both replicas'


def test_status_log_has_the_sum_and_one_line_per_replica(dp_server):
    base, log = dp_server
    stop = threading.Event()
    bodies = [{"prompt": [200 + i] * PROMPT_LEN, "max_tokens": MAX_TOKENS, "ignore_eos": True} for i in range(2)]
    threads = [_stream(base, b, stop) for b in bodies]
    try:
        _until(lambda: any("Running: 2 reqs" in ln for ln in _status_lines(log, "Engine")),
               what="a status line with both replicas' requests")
        _until(lambda: any("Running: 1 reqs" in ln for ln in _status_lines(log, "Engine 000"))
               and any("Running: 1 reqs" in ln for ln in _status_lines(log, "Engine 001")),
               what="a status line of each replica")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not _status_lines(log, "Engine 002")


def test_multi_model_status_log_names_each_model(tmp_path):
    log = tmp_path / "serve.log"
    path = default_gguf_path()
    proc, base = _serve(log, "--model", path, "--model", path, "--served-model-name", "alpha", "beta")
    stop, threads = threading.Event(), []
    try:
        threads.append(_stream(base, {"model": "beta", "prompt": [7] * PROMPT_LEN, "max_tokens": MAX_TOKENS,
                                  "ignore_eos": True}, stop))
        _until(lambda: any("Running: 1 reqs" in ln for ln in _status_lines(log, "Engine [beta]")),
               what="beta's status line")
        assert not _status_lines(log, "Engine [alpha]")  # alpha idle: it says nothing
        assert not _status_lines(log, "Engine")  # every line names its model
        threads.append(_stream(base, {"model": "alpha", "prompt": [9] * PROMPT_LEN, "max_tokens": MAX_TOKENS,
                                      "ignore_eos": True}, stop))
        _until(lambda: any("Running: 1 reqs" in ln for ln in _status_lines(log, "Engine [alpha]")),
               what="alpha's status line")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        _stop(proc)
