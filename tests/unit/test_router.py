"""`minivllm router` against fake instances (no model): the prefill/decode hand-off's requests,
which requests skip the prefill instance, errors passed through or turned into a 502, and a
decode instance dying mid-stream ending the stream with an error event."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, StreamingResponse

from minivllm.server.router import Router, create_router_app, prefill_body
from minivllm.server.testing import ServerThread, free_port, wait_until

ANSWER = {"do_remote_prefill": True, "remote_request_id": "p-1"}


def _prefill_app(seen: list, status: int = 200) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen.append(await request.json())
        if status != 200:
            return JSONResponse({"error": {"message": "bad", "param": "prompt"}}, status_code=status)
        return {"choices": [{"text": "x"}], "kv_transfer_params": ANSWER}

    return app


def _decode_app(seen: list, die_after: int | None = None) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        if not body.get("stream"):
            return {"choices": [{"text": "whole"}], "got": body.get("kv_transfer_params")}

        async def events():
            for i in range(4):
                if die_after is not None and i == die_after:
                    raise RuntimeError("the decode instance died")
                yield f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n"
                await asyncio.sleep(0.01)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def setup():
    started = []

    def make(prefill_status=200, die_after=None, prefill_up=True):
        seen_p, seen_d = [], []
        p = ServerThread(_prefill_app(seen_p, prefill_status)).start() if prefill_up else None
        d = ServerThread(_decode_app(seen_d, die_after)).start()
        p_url = p.base_url if p else f"http://127.0.0.1:{free_port()}"
        router = Router([p_url], [d.base_url], [], timeout_s=30)
        r = ServerThread(create_router_app(router)).start()
        started.extend(x for x in (p, d, r) if x)
        return r.base_url, seen_p, seen_d, router

    yield make
    for s in started:
        s.stop()


def _events(text: str) -> list:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


def test_the_prefill_instance_gets_one_token_and_the_decode_instance_its_answer(setup):
    url, seen_p, seen_d, _ = setup()
    body = {"prompt": "Hi", "max_tokens": 50, "stream": True, "stop": ["\n"], "stream_options": {"include_usage": True}}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert _events(r.text)[-1] == "[DONE]" and [e["choices"][0]["text"] for e in _events(r.text)[:-1]] == list("0123")
    (p,) = seen_p
    assert p["max_tokens"] == 1 and p["kv_transfer_params"] == {"do_remote_decode": True}
    assert "stream" not in p and "stop" not in p and "stream_options" not in p
    (d,) = seen_d
    assert d == {**body, "kv_transfer_params": ANSWER}  # the client's request, plus the hand-off
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 5}, timeout=30)
    assert r.json() == {"choices": [{"text": "whole"}], "got": ANSWER}


@pytest.mark.parametrize("body", [{"prompt": "Hi", "n": 2}, {"prompt": "Hi", "use_beam_search": True},
                                  {"prompt": ["a", "b"]}, {"prompt": "Hi", "echo": True, "logprobs": 1}])
def test_requests_the_hand_off_cannot_serve_go_to_the_decode_instance(setup, body):
    url, seen_p, seen_d, _ = setup()
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and seen_p == [] and seen_d == [body]


def test_a_prefill_instance_that_refuses_connections_is_skipped(setup):
    url, _, seen_d, router = setup(prefill_up=False)
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi"}, timeout=30)
    assert r.status_code == 200 and "kv_transfer_params" not in seen_d[0] and router.num_prefill_skipped == 1


def test_the_prefill_instances_400_reaches_the_client_and_a_500_is_a_502(setup):
    url, _, seen_d, _ = setup(prefill_status=400)
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and seen_d == []
    url, _, seen_d, _ = setup(prefill_status=500)
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi"}, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_failed" and seen_d == []


def test_a_decode_instance_dying_mid_stream_ends_the_stream_with_an_error(setup):
    url, _, _, _ = setup(die_after=2)
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "stream": True}, timeout=30)
    events = _events(r.text)
    assert [e["choices"][0]["text"] for e in events[:2]] == ["0", "1"]
    assert events[2]["error"]["code"] == "upstream_failed" and events[3] == "[DONE]"


def test_bad_json_is_a_400():
    router = Router(["http://127.0.0.1:1"], ["http://127.0.0.1:1"], [], 5)
    with ServerThread(create_router_app(router)) as r:
        resp = httpx.post(r.base_url + "/v1/completions", content=b"{nope", timeout=10)
        assert resp.status_code == 400 and "not JSON" in resp.json()["error"]["message"]


def test_prefill_body_takes_one_prompt_and_no_streaming():
    body = {"prompt": ["only"], "stream": True, "min_tokens": 3, "max_completion_tokens": 9, "logprobs": 2}
    assert prefill_body(body) == {"prompt": "only", "max_tokens": 1, "n": 1,
                                  "kv_transfer_params": {"do_remote_decode": True}}
    assert body["prompt"] == ["only"]  # the client's request is left as it was


def test_plain_instances_share_the_requests():
    """--instance mode: no prefill step; idle instances take requests in turn."""
    seen = [[], []]
    servers = [ServerThread(_decode_app(s)).start() for s in seen]
    router = Router([], [], [s.base_url for s in servers], timeout_s=30)
    try:
        with ServerThread(create_router_app(router)) as r:
            for _ in range(4):
                resp = httpx.post(r.base_url + "/v1/completions", json={"prompt": "Hi"}, timeout=30)
                assert resp.status_code == 200 and resp.json()["got"] is None  # no hand-off
        assert [len(s) for s in seen] == [2, 2]
    finally:
        for s in servers:
            s.stop()


def test_plain_instances_are_ranked_by_their_own_load_report():
    """The router reads each instance's /load: an instance reporting 5 running requests gets none
    of 4 new ones while the other reports an empty queue (4 sent since its report < 5)."""
    seen = [[], []]
    apps = [_decode_app(s) for s in seen]
    for app, running in zip(apps, (5, 0)):
        @app.get("/load")
        async def load(running=running):
            return {"num_requests_running": running, "num_requests_waiting": 0}
    servers = [ServerThread(app).start() for app in apps]
    router = Router([], [], [s.base_url for s in servers], timeout_s=30)
    try:
        with ServerThread(create_router_app(router)) as r:
            wait_until(lambda: all(i["reported"] is not None for i in httpx.get(r.base_url + "/load").json()["decode"]),
                       10.0, "both instances' /load read")
            for _ in range(4):
                assert httpx.post(r.base_url + "/v1/completions", json={"prompt": "Hi"}, timeout=30).status_code == 200
        assert [len(s) for s in seen] == [0, 4]
    finally:
        for s in servers:
            s.stop()
