"""Error handling of the server: every bad input is a 4xx with an OpenAI error body, never a 5xx
(a parameter table, context length, 401, 404, 413, the per-request caps, 429 + Retry-After, and
schemathesis fuzzing of the
server's own OpenAPI schema). One engine (max_model_len 256) behind three in-process apps."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest

from minivllm.engine.mp_async_engine import MPAsyncEngine
from minivllm.server.app import create_app
from minivllm.server.serving_common import ServerSettings
from minivllm.server.testing import ServerThread

MAX_LEN = 256
API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def engine():
    eng = MPAsyncEngine.from_kwargs(dtype="float32", device="cpu", max_model_len=MAX_LEN,
                                  kv_cache_memory_bytes=128 << 20)
    yield eng
    eng.shutdown()


def _serve(engine, **settings) -> ServerThread:
    return ServerThread(create_app(engine, ServerSettings(own_engine=False, **settings))).start()


@pytest.fixture(scope="module")
def server(engine):
    s = _serve(engine)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(engine) -> str:
    return engine.config.model.served_name


def _assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


COMPLETION_CASES = [
    ({"temperature": -1}, "temperature"), ({"temperature": "abc"}, "temperature"), ({"temperature": 1e9}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"), ({"n": "two"}, "n"), ({"n": 1000}, "n"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "ten"}, "max_tokens"), ({"max_tokens": 1.5}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"seed": "x"}, "seed"), ({"seed": 2**70}, "seed"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"1": 500}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"), ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"echo": "maybe"}, "echo"), ({"stream": "maybe"}, "stream"),
    ({"prompt": []}, "prompt"), ({"prompt": [[]]}, "prompt"), ({"prompt": [-1]}, "prompt"),
    ({"prompt": [999999999]}, "prompt"), ({"prompt": 123}, "prompt"), ({"prompt": ""}, "prompt"),
    ({"prompt": None}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": {"text": "x"}}, "prompt"),
]


@pytest.mark.parametrize("patch,param", COMPLETION_CASES, ids=[json.dumps(c[0])[:40] for c in COMPLETION_CASES])
def test_invalid_completion_params_are_400(server, model, patch, param):
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, **patch}
    err = _assert_openai_error(httpx.post(server.base_url + "/v1/completions", json=body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param or param in err["message"], err


CHAT_CASES = [
    ({"messages": []}, "messages"), ({"messages": None}, "messages"), ({"messages": [{"content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     "messages"),
    ({"messages": "hello"}, "messages"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"response_format": {"type": "xml"}},
                                                                "response_format"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"temperature": None, "top_p": -1}, "top_p"),
]


@pytest.mark.parametrize("patch,param", CHAT_CASES, ids=[json.dumps(c[0])[:40] for c in CHAT_CASES])
def test_invalid_chat_params_are_400(server, model, patch, param):
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **patch}
    err = _assert_openai_error(httpx.post(server.base_url + "/v1/chat/completions", json=body), 400)
    assert err["param"] == param or param in err["message"], err


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"null", b'"text"'])
def test_malformed_bodies_are_400(server, raw):
    r = httpx.post(server.base_url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    _assert_openai_error(r, 400)


def test_too_long_prompt_names_the_limit(server, model):
    prompt = "hello " * 400
    r = httpx.post(server.base_url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4})
    err = _assert_openai_error(r, 400)
    assert str(MAX_LEN) in err["message"] and "prompt is" in err["message"]
    assert err["code"] == "context_length_exceeded"
    n = httpx.post(server.base_url + "/tokenize", json={"prompt": prompt}).json()["count"]
    assert str(n) in err["message"]  # the prompt's own length is named too
    chat = {"model": model, "messages": [{"role": "user", "content": prompt}]}
    err = _assert_openai_error(httpx.post(server.base_url + "/v1/chat/completions", json=chat), 400)
    assert str(MAX_LEN) in err["message"]
    r = httpx.post(server.base_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 300})
    assert str(MAX_LEN) in _assert_openai_error(r, 400)["message"]


def test_unknown_model_is_404(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": "gpt-17", "prompt": "Hi"})
    assert _assert_openai_error(r, 404)["param"] == "model"
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"model": "gpt-17", "messages": [{"role": "user", "content": "Hi"}]})
    assert "gpt-17" in _assert_openai_error(r, 404)["message"]


def test_unknown_route_and_method(server):
    _assert_openai_error(httpx.get(server.base_url + "/v1/nothing"), 404)
    _assert_openai_error(httpx.get(server.base_url + "/v1/completions"), 405)


def test_tokenize_detokenize_errors(server):
    _assert_openai_error(httpx.post(server.base_url + "/tokenize", json={}), 400)
    _assert_openai_error(httpx.post(server.base_url + "/tokenize", json={"prompt": "a", "messages": []}), 400)
    _assert_openai_error(httpx.post(server.base_url + "/detokenize", json={"tokens": [10**9]}), 400)
    _assert_openai_error(httpx.post(server.base_url + "/detokenize", json={"tokens": "abc"}), 400)


def test_api_key(engine, model):
    with _serve(engine, api_key=API_KEY) as s:
        body = {"model": model, "prompt": "Hi", "max_tokens": 2}
        assert _assert_openai_error(httpx.post(s.base_url + "/v1/completions", json=body), 401)["type"] == \
            "authentication_error"
        bad = {"Authorization": "Bearer nope"}
        _assert_openai_error(httpx.get(s.base_url + "/v1/models", headers=bad), 401)
        _assert_openai_error(httpx.post(s.base_url + "/tokenize", json={"prompt": "x"}), 401)
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert httpx.post(s.base_url + "/v1/completions", json=body, headers=good).status_code == 200
        assert httpx.get(s.base_url + "/health").status_code == 200  # open
        assert httpx.get(s.base_url + "/metrics").status_code == 200  # open


def test_full_queue_is_429_with_retry_after(engine, model):
    body = {"model": model, "prompt": "Hi", "max_tokens": 2}

    async def main(url):
        async with httpx.AsyncClient(timeout=60) as c:
            engine.pause()  # nothing is scheduled: the first request stays waiting
            try:
                first = asyncio.ensure_future(c.post(url, json=body))
                deadline = time.monotonic() + 10
                while engine.get_stats().num_waiting < 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                second = await c.post(url, json=body)
            finally:
                engine.resume()
            return await first, second

    with _serve(engine, max_queue=1) as s:
        first, second = asyncio.run(main(s.base_url + "/v1/completions"))
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 2
    err = _assert_openai_error(second, 429)
    assert second.headers["retry-after"] == "1" and err["code"] == "server_overloaded"


def test_tokens_in_flight_cap_is_429_then_the_server_serves(engine, model):
    """A request whose prompt + max_tokens would pass --max-tokens-in-flight is refused with 429;
    one that fits is served."""
    with _serve(engine, max_tokens_in_flight=100) as s:
        big = httpx.post(s.base_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 150})
        err = _assert_openai_error(big, 429)
        assert "max-tokens-in-flight" in err["message"] and big.headers["retry-after"] == "1"
        ok = httpx.post(s.base_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("body,param", [
    ({"prompt": ["a"] * 5}, "prompt"),
    ({"prompt": "a", "n": 3}, "n"),
    ({"prompt": "a", "stop": ["x", "y", "z"]}, "stop"),
    ({"prompt": "a", "logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias"),
])
def test_per_request_caps_are_400_naming_the_field(engine, model, body, param):
    limits = dict(max_prompts_per_request=4, max_n=2, max_stop_sequences=2, max_logit_bias=2)
    with _serve(engine, **limits) as s:
        r = httpx.post(s.base_url + "/v1/completions", json={"model": model, "max_tokens": 2, **body})
        err = _assert_openai_error(r, 400)
        assert err["param"] == param and "at most" in err["message"]
        ok = httpx.post(s.base_url + "/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 2})
        assert ok.status_code == 200


def test_request_body_over_the_limit_is_413_announced_or_streamed(engine, model):
    with _serve(engine, max_body_bytes=4096) as s:
        body = json.dumps({"model": model, "prompt": "word " * 2000, "max_tokens": 1}).encode()
        url = s.base_url + "/v1/completions"
        _assert_openai_error(httpx.post(url, content=body, headers={"content-type": "application/json"}), 413)

        def chunks():  # no Content-Length: counted as it arrives
            for i in range(0, len(body), 1000):
                yield body[i:i + 1000]
        _assert_openai_error(httpx.post(url, content=chunks(), headers={"content-type": "application/json"}), 413)
        ok = httpx.post(url, json={"model": model, "prompt": "Hi", "max_tokens": 1})
        assert ok.status_code == 200


# ---- schemathesis -------------------------------------------------------------------------------
_HOOKS = '''
import os

import schemathesis

LIMIT = 4  # keep generation short: every generated request finishes in a fraction of a second


def _is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@schemathesis.hook
def before_call(context, case, kwargs):
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is None or (_is_num(v) and v > LIMIT):
            body[key] = LIMIT
    if _is_num(body.get("n")) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 3:
        body["prompt"] = body["prompt"][:3]
    # cross-field rules the schema cannot say: satisfy them often, so that generation is reached
    if body.get("top_logprobs") is not None and "logprobs" not in body:
        body["logprobs"] = True
    if body.get("stream_options") is not None and "stream" not in body:
        body["stream"] = True


@schemathesis.hook
def after_call(context, case, response):
    with open(os.environ["ST_STATUS_LOG"], "a") as f:
        f.write(f"{case.method} {case.path} {response.status_code}\\n")
'''


def _tighten(schema: dict, model: str) -> dict:
    """The server's schema, with `model` pinned to the served name (else nearly every case is a
    404) and list sizes bounded (short runs)."""
    for comp in schema["components"]["schemas"].values():
        props = comp.get("properties", {})
        if "model" in props:
            props["model"] = {"anyOf": [{"type": "string", "enum": [model]}, {"type": "null"}]}
        for name in ("n",):
            if name in props:
                props[name]["maximum"] = 2
        for name in ("prompt", "messages", "tokens", "stop", "stop_token_ids"):
            for option in props.get(name, {}).get("anyOf", [props.get(name, {})]):
                if option.get("type") == "array":
                    option["maxItems"] = 3
    return schema


def test_schemathesis_finds_no_server_errors(server, model, tmp_path):
    schema = _tighten(httpx.get(server.base_url + "/openapi.json").json(), model)
    (tmp_path / "openapi.json").write_text(json.dumps(schema))
    (tmp_path / "st_hooks.py").write_text(_HOOKS)
    status_log = tmp_path / "status.log"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "st_hooks", "ST_STATUS_LOG": str(status_log),
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", str(tmp_path / "openapi.json"), "--url", server.base_url,
           "--checks", "not_a_server_error", "--max-examples", "160", "--workers", "1", "--seed", "0",
           "--phases", "examples,coverage,fuzzing", "--request-timeout", "60",
           "--suppress-health-check", "all", "--report", "ndjson", "--report-dir", str(tmp_path)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    calls = [line.rsplit(" ", 1) for line in status_log.read_text().splitlines()]
    statuses = Counter(int(code) for _, code in calls)
    assert len(calls) >= 1000 and not any(code >= 500 for code in statuses), statuses
    ok = Counter(op for op, code in calls if code == "200")
    # the fuzzing did reach generation, not only validation errors
    assert ok["POST /v1/completions"] >= 20 and ok["POST /v1/chat/completions"] >= 20, ok
    print(f"schemathesis: {len(calls)} requests in {time.monotonic() - t0:.0f} s, status codes {dict(statuses)}, "
          f"200s per operation {dict(ok)}")
