"""`minivllm router`: one OpenAI endpoint in front of several `minivllm serve` instances.

Disaggregated prefill/decode (--prefill URL... --decode URL...), the flow of vLLM's P/D proxy:

    client -> router -> prefill instance: the request with max_tokens 1, stream off and
                        kv_transfer_params {"do_remote_decode": true}; it computes the prompt,
                        holds its KV blocks and answers where they are (kv_transfer_params)
                     -> decode instance: the original request + those kv_transfer_params; it
                        pulls the blocks (or recomputes the prompt if the pull fails), samples
                        the first token itself and streams; the router passes its response through

Requests the hand-off cannot serve go to a decode instance directly (it computes the prompt):
n > 1, beam search, several prompts, echo (prompt logprobs need every prompt position computed
there), max_tokens 0. A prefill instance that cannot be reached at all is skipped the same way
(and avoided for a few seconds); one that fails once it has the request gives the client an
error (502, OpenAI's error body), never a hang. A decode instance that dies mid-stream ends the
stream with an error event.

Plain data parallelism (--instance URL...): each request goes to the least loaded instance. Load
comes from each instance's GET /load, polled every LOAD_POLL_S (running + waiting requests, plus
those this router sent it since that report, so a burst between two polls spreads out); an
instance whose report is older than LOAD_FRESH_S (unreachable, or not a minivllm server) is ranked
by the requests in flight through this router instead. The prefill and decode pools of the
disaggregated mode pick the same way.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from minivllm.server.errors import JSONResponse, dumps, error_body

logger = logging.getLogger(__name__)

DOWN_S = 5.0  # an instance that refused a connection is skipped this long
LOAD_POLL_S = 0.1  # how often each instance's /load is read
LOAD_FRESH_S = 1.0  # a /load report older than this is not used
_HOP_HEADERS = {"authorization"}  # forwarded to the instances as the client sent them


@dataclass(eq=False)
class Instance:
    url: str
    in_flight: int = 0  # requests of this router it is serving now
    down_until: float = 0.0
    reported: int | None = None  # running + waiting requests in its last /load
    reported_at: float = 0.0
    sent_since_report: int = 0

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def score(self, now: float) -> int:
        """How busy it is: its own last report plus what was sent since, else this router's view."""
        if self.reported is not None and now - self.reported_at <= LOAD_FRESH_S:
            return self.reported + self.sent_since_report
        return self.in_flight

    def take_report(self, load: dict, now: float) -> None:
        self.reported = int(load["num_requests_running"]) + int(load["num_requests_waiting"])
        self.reported_at, self.sent_since_report = now, 0


class InstancePool:
    """Instances of one kind; picks the least loaded (Instance.score; ties: in turn)."""

    def __init__(self, urls: list[str]) -> None:
        self.instances = [Instance(u.rstrip("/")) for u in urls]
        self._turn = 0

    def pick(self) -> Instance | None:
        up = [i for i in self.instances if i.up]
        if not up:
            return None
        self._turn += 1
        order = up[self._turn % len(up):] + up[:self._turn % len(up)]
        now = time.monotonic()
        best = min(order, key=lambda i: i.score(now))
        best.sent_since_report += 1
        return best

    def __bool__(self) -> bool:
        return bool(self.instances)


class UpstreamError(Exception):
    """An instance failed once it had the request: the client gets a 502."""


class Router:
    def __init__(self, prefill: list[str], decode: list[str], instances: list[str], timeout_s: float) -> None:
        self.prefill = InstancePool(prefill)
        self.decode = InstancePool(decode or instances)
        self.disaggregated = bool(prefill)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))
        self.num_prefill_skipped = 0  # requests sent to a decode instance without a remote prefill

    async def close(self) -> None:
        await self.client.aclose()

    async def poll_loads(self) -> None:
        """Reads every instance's /load every LOAD_POLL_S, for as long as the router runs."""
        instances = self.prefill.instances + self.decode.instances
        while True:
            await asyncio.gather(*(self._read_load(i) for i in instances))
            await asyncio.sleep(LOAD_POLL_S)

    async def _read_load(self, inst: Instance) -> None:
        try:
            r = await self.client.get(inst.url + "/load", timeout=0.5)
            if r.status_code == 200:
                inst.take_report(r.json(), time.monotonic())
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass  # no fresh report: ranked by this router's own count until one comes

    # ---- one request -------------------------------------------------------------------------
    async def handle(self, request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"the request body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _HOP_HEADERS}
        try:
            if self.disaggregated and _disaggregable(body, path):
                answer = await self._prefill(path, body, headers)
                if isinstance(answer, Response):
                    return answer  # the prefill instance refused the request (the client's error)
                if answer is not None:
                    body = {**body, "kv_transfer_params": answer}
            return await self._forward(self.decode, path, body, headers)
        except UpstreamError as e:
            return _error(502, str(e), code="upstream_failed")

    async def _prefill(self, path: str, body: dict, headers: dict) -> dict | Response | None:
        """The prefill instance's kv_transfer_params; None: no prefill instance reachable (the
        decode instance computes the prompt); a Response: the instance refused the request."""
        while True:
            inst = self.prefill.pick()
            if inst is None:
                self.num_prefill_skipped += 1
                return None
            inst.in_flight += 1
            try:
                r = await self.client.post(inst.url + path, json=prefill_body(body), headers=headers)
            except httpx.ConnectError:
                inst.down_until = time.monotonic() + DOWN_S
                logger.warning("prefill instance %s refused the connection; skipped for %.0f s", inst.url, DOWN_S)
                continue
            except httpx.HTTPError as e:
                raise UpstreamError(f"prefill instance {inst.url} failed: {type(e).__name__}: {e}") from None
            finally:
                inst.in_flight -= 1
            if r.status_code != 200:
                if r.status_code >= 500:
                    raise UpstreamError(f"prefill instance {inst.url} answered {r.status_code}: {r.text[:500]}")
                return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
            return r.json().get("kv_transfer_params")

    async def _forward(self, pool: InstancePool, path: str, body: dict, headers: dict) -> Response:
        """Sends the request to the pool's pick and passes its answer through (streamed or whole)."""
        inst = pool.pick()
        if inst is None:
            raise UpstreamError("no instance can be reached (each refused a connection in the last "
                                f"{DOWN_S:.0f} s)")
        inst.in_flight += 1
        try:
            upstream = await self.client.send(self.client.build_request("POST", inst.url + path, json=body,
                                                                        headers=headers), stream=True)
        except httpx.HTTPError as e:
            inst.in_flight -= 1
            if isinstance(e, httpx.ConnectError):
                inst.down_until = time.monotonic() + DOWN_S
            raise UpstreamError(f"instance {inst.url} failed: {type(e).__name__}: {e}") from None
        streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")
        if not streaming:
            try:
                content = await upstream.aread()
            except httpx.HTTPError as e:
                raise UpstreamError(f"instance {inst.url} failed: {type(e).__name__}: {e}") from None
            finally:
                await upstream.aclose()
                inst.in_flight -= 1
            return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"))
        return StreamingResponse(_relay_events(upstream, inst), status_code=upstream.status_code,
                                 media_type="text/event-stream")

    async def models(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in _HOP_HEADERS}
        inst = self.decode.pick()
        if inst is None:
            return _error(502, "no instance can be reached")
        try:
            r = await self.client.get(inst.url + "/v1/models", headers=headers)
        except httpx.HTTPError as e:
            return _error(502, f"instance {inst.url} failed: {type(e).__name__}: {e}")
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))


async def _relay_events(upstream: httpx.Response, inst: Instance) -> AsyncIterator[bytes]:
    """The instance's SSE bytes as they come; if it dies mid-stream, an error event and [DONE]
    end the stream (after closing a partly sent event), so a client never waits on a dead instance."""
    at_boundary = True  # the bytes sent so far end between two events
    try:
        async for chunk in upstream.aiter_raw():
            if chunk:
                at_boundary = chunk.endswith(b"\n\n")
                yield chunk
    except httpx.HTTPError as e:
        body = error_body(502, f"instance {inst.url} failed mid-stream: {type(e).__name__}: {e}", code="upstream_failed")
        yield ("" if at_boundary else "\n\n").encode() + f"data: {dumps(body)}\n\ndata: [DONE]\n\n".encode()
    finally:
        await upstream.aclose()
        inst.in_flight -= 1


def _disaggregable(body: dict, path: str) -> bool:
    """Whether the prefill/decode hand-off can serve this request (else the decode instance
    computes the prompt itself)."""
    if body.get("kv_transfer_params") is not None or body.get("use_beam_search"):
        return False
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return False
    if path.endswith("/completions") and "chat" not in path:
        prompt = body.get("prompt")
        several = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        if several and len(prompt) != 1 or body.get("echo") or body.get("max_tokens") == 0:
            return False
    return True


def prefill_body(body: dict) -> dict:
    """The request as the prefill instance gets it: one token, no stream, no stop strings (a stop
    string ends a request after its blocks are released), and the hand-off asked for."""
    out = copy.deepcopy(body)
    for key in ("stream", "stream_options", "stop", "min_tokens", "max_completion_tokens", "logprobs", "top_logprobs"):
        out.pop(key, None)
    if isinstance(out.get("prompt"), list) and out["prompt"] and isinstance(out["prompt"][0], str):
        out["prompt"] = out["prompt"][0]
    out.update(max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
    return out


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code=code), status_code=status)


def create_router_app(router: Router) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        poller = asyncio.create_task(router.poll_loads())
        yield
        poller.cancel()
        await router.close()

    app = FastAPI(title="minivllm router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/load")
    async def load() -> Response:
        pools = {"prefill": router.prefill, "decode": router.decode}
        return JSONResponse({name: [{"url": i.url, "in_flight": i.in_flight, "up": i.up, "reported": i.reported}
                                    for i in pool.instances]
                             for name, pool in pools.items()} | {"prefill_skipped": router.num_prefill_skipped})

    return app
