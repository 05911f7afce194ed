"""`minivllm serve` as a real process: flags (API key, served model names) and graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from minivllm.server.testing import free_port

KEY = "sk-lifecycle"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRACE_S = 4


@pytest.fixture(scope="module")
def cli_server():
    port = free_port()
    cmd = [sys.executable, "-m", "minivllm", "serve", "--port", str(port), "--api-key", KEY,
           "--served-model-name", "mini", "smol", "--max-model-len", "512", "--kv-cache-memory-bytes",
           str(128 << 20), "--dtype", "float32", "--device", "cpu", "--shutdown-timeout", str(GRACE_S)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_api_key_and_served_names(cli_server):
    _, base = cli_server
    body = {"model": "smol", "prompt": "Hello", "max_tokens": 3}
    assert httpx.post(base + "/v1/completions", json=body).status_code == 401
    assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert [m["id"] for m in httpx.get(base + "/v1/models", headers=AUTH).json()["data"]] == ["mini", "smol"]
    r = httpx.post(base + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "smol"
    r = httpx.post(base + "/v1/completions", json={**body, "model": "SmolLM2-135M-Instruct"}, headers=AUTH)
    assert r.status_code == 404


async def _stream(client: httpx.AsyncClient, base: str, max_tokens: int, started: asyncio.Event) -> dict:
    body = {"model": "mini", "prompt": "Tell me a story.", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events, done = [], False
    async with client.stream("POST", base + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                started.set()
    finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]]
    usage = [e["usage"] for e in events if e.get("usage")]
    return {"done": done, "finish": finish, "tokens": usage[-1]["completion_tokens"] if usage else None,
            "errors": [e["error"] for e in events if "error" in e]}


def test_sigterm_drains_in_flight_requests_and_exits_0(cli_server):
    proc, base = cli_server

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            s1, s2 = asyncio.Event(), asyncio.Event()
            short = asyncio.ensure_future(_stream(c, base, 8, s1))
            long = asyncio.ensure_future(_stream(c, base, 480, s2))
            await asyncio.wait_for(asyncio.gather(s1.wait(), s2.wait()), 60)
            proc.send_signal(signal.SIGTERM)  # both requests are in flight
            return await short, await long

    t0 = time.monotonic()
    short, long = asyncio.run(main())
    rc = proc.wait(timeout=GRACE_S + 60)
    log = proc.stdout.read()
    assert rc == 0, log[-3000:]
    # the short request finishes normally within the grace period
    assert short["done"] and short["finish"] == ["length"] and short["tokens"] == 8, short
    # the long one cannot: it is aborted at the deadline, and still gets a terminal chunk and [DONE]
    assert long["done"] and long["finish"] == ["abort"], long
    assert time.monotonic() - t0 < GRACE_S + 60
    assert "Application shutdown complete" in log


def _serve(*extra) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "minivllm", "serve", "--port", str(port), "--max-model-len", "256",
           "--kv-cache-memory-bytes", str(64 << 20), "--dtype", "float32", "--device", "cpu",
           "--served-model-name", "mini", "--api-key", KEY, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def _engine_core(proc) -> "psutil.Process":  # noqa: F821
    import psutil
    # (the other child is multiprocessing's resource tracker)
    children = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
    assert len(children) == 1, children
    return children[0]


def test_a_dead_engine_core_fails_requests_and_the_server_exits_nonzero():
    """The engine core is killed mid-generation: the in-flight request gets an error within a
    second, /health says 503 while the server stops, and `minivllm serve` exits with status 1 (so
    a supervisor restarts it) instead of serving nothing forever."""
    proc, base = _serve()
    try:
        core = _engine_core(proc)

        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                started = asyncio.Event()
                task = asyncio.ensure_future(_stream(c, base, 200, started))
                await asyncio.wait_for(started.wait(), 60)
                core.kill()
                t0 = time.monotonic()
                result = await task
                return result, time.monotonic() - t0

        result, seconds = asyncio.run(main())
        assert seconds < 1.5, seconds
        assert result["done"] and result["finish"] != ["length"], result
        assert result["errors"] or result["finish"] == ["error"], result  # told, not left hanging
        rc = proc.wait(timeout=60)
        assert rc == 1, proc.stdout.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_killed_server_leaves_no_engine_core_behind():
    proc, _ = _serve()
    core = _engine_core(proc)
    proc.kill()  # SIGKILL: no shutdown code runs in the server
    proc.wait()
    core.wait(timeout=15)  # raises psutil.TimeoutExpired if the engine core outlived its server
