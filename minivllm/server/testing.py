"""Helpers for tests and benchmarks: run an app on uvicorn in a background thread."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread (no signal handling:
    only the main thread may install handlers, and uvicorn skips it elsewhere)."""

    def __init__(self, app, port: int | None = None, log_level: str = "warning") -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        if self.thread.is_alive():
            return self
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_until(pred, timeout_s: float = 30.0, what: str = "condition", poll_s: float = 0.1):
    """pred()'s first truthy value, polled every poll_s; an AssertionError naming `what` after
    timeout_s (tests wait for a server's state this way)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached"
        time.sleep(poll_s)


def pid_gone(pid: int, timeout_s: float = 20.0) -> bool:
    """Whether process `pid` (of this machine) is gone within timeout_s (tests: nothing left behind)."""
    import os
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def spawn_server(cmd: list[str], base_url: str, timeout_s: float = 300.0, path: str = "/health",
                 log=None, env: dict | None = None):
    """Start a server process (`cmd`, environment `env`) and wait until GET base_url + path answers
    200; the process (stdout and stderr to one pipe, or to the file `log` when given). Raises with
    the process's output if it exits first."""
    import subprocess

    import httpx
    out = open(log, "w") if log is not None else subprocess.PIPE
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            output = open(log).read() if log is not None else proc.stdout.read()
            raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}: {output[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{cmd[:4]} did not answer {path} within {timeout_s} s")
        try:
            if httpx.get(base_url + path, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def greedy_completion_texts(http, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    """One /v1/completions request for every prompt, greedy and ignore_eos, on an httpx client
    of a running server: the choices' texts in prompt order (asserts a 200)."""
    body = {"model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
