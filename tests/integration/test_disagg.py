"""Disaggregated prefill/decode on one machine: a prefill instance, a decode instance and the
router, three processes on free ports (CPU, the default model, float32).

Greedy outputs through the router equal a single instance's (the conftest `llm`), streaming and
not, completions and chat; the decode instance really pulled the prompts' K/V; every KV block is
free again on both instances afterwards; a pull that fails is recomputed; a router pointed at an
instance of the wrong role exits at startup naming the URL; killing the prefill instance
mid-request gives the client an error, not a hang, and the router keeps serving (last test).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from minivllm import SamplingParams
from minivllm.server.testing import free_port, spawn_server
from tests.integration.conftest import CHAT_PROMPTS, LONG_TEXT

MAX_TOKENS = 24
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Summarize: " + LONG_TEXT]


def _serve_cmd(port: int, role: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "minivllm", "serve", "--port", str(port), "--max-model-len", "2048",
           "--kv-cache-memory-bytes", str(128 << 20), "--dtype", "float32", "--device", "cpu", "--no-dashboard",
           "--uvicorn-log-level", "warning"]
    if role is not None:
        cmd += ["--kv-transfer-config", json.dumps({"kv_role": role})]
    return cmd


def _router_cmd(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "minivllm", "router", "--port", str(port), *args]


@pytest.fixture(scope="module")
def pd():
    procs = []
    try:
        urls = {}
        for role in ("kv_producer", "kv_consumer"):
            port = free_port()
            urls[role] = f"http://127.0.0.1:{port}"
            procs.append(spawn_server(_serve_cmd(port, role), urls[role]))
        port = free_port()
        router = f"http://127.0.0.1:{port}"
        procs.append(spawn_server(_router_cmd(port, "--prefill", urls["kv_producer"], "--decode",
                                              urls["kv_consumer"]), router, timeout_s=120))
        yield {"prefill": urls["kv_producer"], "decode": urls["kv_consumer"], "router": router,
               "prefill_proc": procs[0]}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def expected(llm) -> dict[str, str]:
    """A single instance's greedy completions of PROMPTS and chat answers of CHAT_PROMPTS[:3]."""
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out = {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, sp, use_tqdm=False))}
    for q in CHAT_PROMPTS[:3]:
        out["chat:" + q] = llm.chat([{"role": "user", "content": q}], sp, use_tqdm=False)[0].outputs[0].text
    return out


def _stream_text(client: httpx.Client, url: str, body: dict) -> tuple[str, str | None]:
    """(the streamed text, the finish_reason) of one streamed choice; an error event fails."""
    text, finish = "", None
    with client.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                finish = c.get("finish_reason") or finish
    return text, finish


def _load(url: str) -> dict:
    return httpx.get(url + "/load", timeout=10).json()


def _wait_blocks_free(url: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        load = _load(url)
        if load["num_free_kv_blocks"] == load["num_kv_blocks"] and load["kv_held_requests"] == 0:
            return load
        assert time.monotonic() < deadline, f"KV blocks still in use at {url}: {load}"
        time.sleep(0.2)


def test_greedy_through_the_router_equals_a_single_instance(pd, expected):
    before = _load(pd["decode"])
    with httpx.Client(timeout=300) as client:
        for p in PROMPTS:
            body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
            r = client.post(pd["router"] + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected[p]
            assert "kv_transfer_params" not in r.json()  # the decode instance's answer, not the hand-off
            assert _stream_text(client, pd["router"] + "/v1/completions", body) == (expected[p], "length")
        for q in CHAT_PROMPTS[:3]:
            body = {"messages": [{"role": "user", "content": q}], "max_tokens": MAX_TOKENS, "temperature": 0}
            r = client.post(pd["router"] + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == expected["chat:" + q]
            text, _ = _stream_text(client, pd["router"] + "/v1/chat/completions", body)
            assert text == expected["chat:" + q]
    after = _load(pd["decode"])
    assert after["kv_pull_failures"] == before["kv_pull_failures"]
    # the long prompt's blocks at least were pulled (short prompts may be served by the decode
    # instance's own prefix cache on their second run)
    assert after["kv_pulled_blocks"] - before["kv_pulled_blocks"] >= 400 // 16
    _wait_blocks_free(pd["prefill"])
    _wait_blocks_free(pd["decode"])


def test_the_prefill_instance_answers_where_the_blocks_are(pd):
    body = {"prompt": PROMPTS[2], "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(pd["prefill"] + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["num_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"]) == -(-params["num_tokens"] // params["block_size"])
    assert _load(pd["prefill"])["kv_held_requests"] == 1  # pinned until a consumer pulls them
    # the decode instance pulls them: the same text as the prompt computed there
    full = {"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0}
    r2 = httpx.post(pd["decode"] + "/v1/completions", json={**full, "kv_transfer_params": params}, timeout=300)
    assert r2.status_code == 200, r2.text
    _wait_blocks_free(pd["prefill"])


def test_a_failed_pull_is_recomputed(pd, expected):
    """kv_transfer_params pointing at no producer: the decode instance computes the prompt itself."""
    from minivllm.kv_transfer.params import prompt_hash
    failures = _load(pd["decode"])["kv_pull_failures"]
    ids = httpx.post(pd["decode"] + "/tokenize", json={"prompt": PROMPTS[2]}, timeout=60).json()["tokens"]
    bogus = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": "x",
             "remote_block_ids": list(range(len(ids) // 16 + 1)), "remote_host": "127.0.0.1",
             "remote_port": free_port(), "num_tokens": len(ids), "block_size": 16, "prompt_hash": prompt_hash(ids)}
    body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "kv_transfer_params": bogus}
    r = httpx.post(pd["decode"] + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected[PROMPTS[2]]
    assert _load(pd["decode"])["kv_pull_failures"] == failures + 1
    _wait_blocks_free(pd["decode"])


@pytest.mark.parametrize("params, field", [
    ({"do_remote_prefill": True, "remote_block_ids": "1,2"}, "kv_transfer_params"),
    ("yes", "kv_transfer_params"),
])
def test_bad_kv_transfer_params_are_a_400_naming_the_field(pd, params, field):
    r = httpx.post(pd["decode"] + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "kv_transfer_params": params},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and "kv_transfer_params" in r.json()["error"]["message"]


def test_a_role_the_instance_does_not_have_is_a_400(pd):
    body = {"prompt": "Hi", "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(pd["decode"] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "kv_producer" in r.json()["error"]["message"], r.text


def test_a_router_pointed_at_the_wrong_role_exits_at_startup(pd):
    cases = [(["--prefill", pd["decode"], "--decode", pd["decode"]], f"--prefill {pd['decode']} is not a KV producer"),
             (["--prefill", pd["prefill"], "--decode", pd["prefill"]], f"--decode {pd['prefill']} is not a KV consumer")]
    dead = f"http://127.0.0.1:{free_port()}"
    cases.append((["--prefill", dead, "--decode", pd["decode"], "--startup-timeout", "1"], f"{dead} cannot be reached"))
    for args, message in cases:
        done = subprocess.run(_router_cmd(free_port(), *args), capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, (done.returncode, done.stderr)


def test_offline_llm_with_both_roles_hands_a_prompt_to_itself(expected):
    """LLM(kv_transfer_config=...): one engine as producer and consumer (no prefix caching, so the
    whole prompt is pulled over the socket); the result is the single instance's, no block leaks."""
    from minivllm import LLM
    llm = LLM(dtype="float32", device="cpu", max_model_len=2048, kv_cache_memory_bytes=128 << 20,
              enable_prefix_caching=False, kv_transfer_config={"kv_role": "kv_both"})
    engine = llm.llm_engine
    free = engine.block_manager.num_free_blocks
    prefill = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    params = llm.generate([PROMPTS[2]], prefill, use_tqdm=False)[0].kv_transfer_params
    assert params is not None and engine.block_manager.num_free_blocks < free  # held for the pull
    decode = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, extra_args={"kv_transfer_params": params})
    out = llm.generate([PROMPTS[2]], decode, use_tqdm=False)[0]
    assert out.outputs[0].text == expected[PROMPTS[2]]
    stats = engine.get_stats()
    # the K/V of every prompt token but the last, which the consumer computes itself
    assert stats.kv_pulled_blocks == -(-(params["num_tokens"] - 1) // params["block_size"])
    assert stats.kv_pull_failures == 0
    for _ in range(100):  # the engine frees the producer's blocks at its next steps
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert engine.block_manager.num_free_blocks == free
    engine.shutdown()


def test_killing_the_prefill_instance_mid_request_gives_an_error_not_a_hang(pd, expected):
    """(Last: it kills the module's prefill instance.) Long prompts keep the prefill instance
    busy; it is killed once it holds requests. Every client gets an answer: an error (502 with
    OpenAI's error body) for the requests it held. The router still serves afterwards (the decode
    instance computes prompts while the prefill instance refuses connections)."""
    long_prompts = [f"Request {i}. " + LONG_TEXT * 2 for i in range(4)]  # ~1,600 tokens each
    results: dict[int, object] = {}

    def send(i: int, stream: bool) -> None:
        body = {"prompt": long_prompts[i], "max_tokens": 8, "temperature": 0, "stream": stream}
        try:
            r = httpx.post(pd["router"] + "/v1/completions", json=body, timeout=300)
            results[i] = (r.status_code, r.text)
        except httpx.HTTPError as e:
            results[i] = e

    threads = [threading.Thread(target=send, args=(i, i % 2 == 1)) for i in range(len(long_prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while True:
        load = _load(pd["prefill"])
        if load["num_requests_running"] + load["num_requests_waiting"] > 0:
            break
        assert time.monotonic() < deadline and not results, f"the prefill instance never got the requests: {results}"
        time.sleep(0.02)
    pd["prefill_proc"].kill()
    pd["prefill_proc"].wait()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a client hangs after the prefill instance died"
    statuses = [r[0] for r in results.values() if isinstance(r, tuple)]
    assert len(statuses) == len(long_prompts), results  # every client got an HTTP answer
    errors = [json.loads(text) for status, text in results.values() if status == 502]
    assert errors and all(e["error"]["code"] == "upstream_failed" for e in errors), results
    assert all(s in (200, 502) for s in statuses), results
    # the router keeps serving: the decode instance computes the prompt itself
    r = httpx.post(pd["router"] + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                            "temperature": 0}, timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[PROMPTS[0]], r.text
