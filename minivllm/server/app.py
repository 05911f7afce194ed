"""The FastAPI app factory: routes, API-key check, error mapping, lifespan (engine shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from minivllm import __version__
from minivllm.engine.async_engine import AsyncEngine, EngineDeadError
from minivllm.server.dashboard import dashboard_router, load_router, profile_router
from minivllm.server.errors import JSONResponse, OpenAIError, bad_request, error_response, install_error_handlers
from minivllm.server.metrics import ServerMetrics
from minivllm.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    ErrorResponse,
    LoadLoRARequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from minivllm.server.serving_chat import ServingChat, chat_prompt_ids
from minivllm.server.serving_common import ServerSettings, ServingBase
from minivllm.server.serving_completions import ServingCompletion
from minivllm.server.status_log import start_status_log
from minivllm.server.serving_embeddings import ServingEmbedding

logger = logging.getLogger(__name__)

_OPEN_PATHS = ("/health", "/metrics", "/load", "/version", "/ping", "/openapi.json", "/docs", "/redoc")
_QUERY_KEY_PATHS = ("/dashboard",)  # a browser's page load and EventSource send the key as ?api_key=
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)}


class BodyLimitMiddleware:
    """413 for a request body over max_bytes, whether announced (Content-Length) or streamed
    (chunked): the body is counted as it arrives and never buffered past the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                           "(--max-request-body-bytes)", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        seen, over = 0, False

        async def counted() -> dict:
            # past the limit the app is told the client left (it stops reading, answers nothing)
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if not over:
                await send(message)

        try:
            await self.app(scope, counted, guarded_send)
        except Exception:
            if not over:
                raise
        if over:
            await error_response(self._too_large())(scope, receive, send)





class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>`; health, metrics, version and docs stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(_OPEN_PATHS) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        got = dict(scope["headers"]).get(b"authorization", b"")
        if scope["path"].startswith(_QUERY_KEY_PATHS) and not got:
            got = b"Bearer " + _query_key(scope)
        if not secrets.compare_digest(got, self.expected):
            err = OpenAIError(401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                              code="invalid_api_key")
            await error_response(err)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _query_key(scope: Scope) -> bytes:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key", [""])
    return values[0].encode("latin-1", "replace")


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    state: ServerState = app.state.minivllm
    status = start_status_log(state)
    yield
    if status is not None:
        status.cancel()
    state.metrics.close()
    if state.settings.own_engine:
        await asyncio.to_thread(state.engine.shutdown, state.settings.shutdown_grace_s)


class ServerState:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.base = ServingBase(engine, settings)
        loras = self.base.loras  # one registry: every endpoint sees the same adapters
        for name, path in settings.lora_modules:
            loras.add(name, path)  # a bad adapter stops startup with its ValueError
        self.completions = ServingCompletion(engine, settings, loras)
        self.chat = ServingChat(engine, settings, loras)
        self.embeddings = ServingEmbedding(engine, settings, loras)
        self.metrics = ServerMetrics(engine, self.base.model_name)


def _state(request: Request) -> ServerState:
    return request.app.state.minivllm


def create_app(engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    app = FastAPI(title="minivllm OpenAI-compatible server", version=__version__, lifespan=_lifespan)
    app.state.minivllm = ServerState(engine, settings)
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)  # outermost: before any parsing
    app.include_router(_openai_router())
    app.include_router(_utility_router())
    app.include_router(load_router())
    if settings.enable_dashboard:
        app.include_router(dashboard_router())
    if settings.profile_dir:
        app.include_router(profile_router())
    return app


def _openai_router() -> APIRouter:
    r = APIRouter()

    @r.post("/v1/completions", responses={200: {"model": CompletionResponse}, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _state(request).completions.create(body, request)

    @r.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _state(request).chat.create(body, request)

    @r.post("/v1/embeddings", responses=_ERRORS)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await _state(request).embeddings.create(body, request)

    @r.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models(request: Request) -> Response:
        s = _state(request)
        cards = [ModelCard(id=name, root=s.engine.config.model.source_path, max_model_len=s.engine.max_model_len)
                 for name in s.base.model_names]
        cards += [ModelCard(id=name, root=lora.lora_path, parent=s.base.model_name, max_model_len=s.engine.max_model_len)
                  for name, lora in s.base.loras.adapters.items()]
        return JSONResponse(ModelList(data=cards).model_dump())

    @r.post("/v1/load_lora_adapter", responses=_ERRORS)
    async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> Response:
        return Response(_state(request).base.loras.load_endpoint(body.lora_name, body.lora_path), media_type="text/plain")

    @r.post("/v1/unload_lora_adapter", responses=_ERRORS)
    async def unload_lora_adapter(body: LoadLoRARequest, request: Request) -> Response:
        loras = _state(request).base.loras
        if not body.lora_name:
            raise bad_request("lora_name is required", "lora_name")
        loras.remove(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    return r


def _utility_router() -> APIRouter:
    r = APIRouter()

    @r.get("/health", responses=_ERRORS)
    async def health(request: Request) -> Response:
        try:
            _state(request).engine.check_health()
        except EngineDeadError as e:
            return error_response(OpenAIError(503, str(e), code="engine_dead"))
        return Response(status_code=200)

    @r.get("/version", response_model=VersionResponse)
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @r.get("/metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @r.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        s = _state(request)
        s.base.check_model(body.model)
        tokens = _tokenize(s, body)
        return JSONResponse({"count": len(tokens), "max_model_len": s.engine.max_model_len, "tokens": tokens})

    @r.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        s = _state(request)
        s.base.check_model(body.model)
        return JSONResponse({"prompt": _detokenize(s, body.tokens)})

    return r


def _tokenize(s: ServerState, body: TokenizeRequest) -> list[int]:
    tok = s.engine.tokenizer
    if tok is None:
        raise bad_request("the server runs without a tokenizer")
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt (text) or messages (a conversation)", "prompt")
    if body.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        return chat_prompt_ids(tok, body.messages, body.add_generation_prompt, body.continue_final_message, tools)
    try:
        return list(tok(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
    except Exception as e:  # noqa: BLE001 - e.g. text the tokenizer cannot encode
        raise bad_request(f"could not tokenize the prompt: {type(e).__name__}: {e}", "prompt") from None


def _detokenize(s: ServerState, tokens: list[int]) -> str:
    tok = s.engine.tokenizer
    if tok is None:
        raise bad_request("the server runs without a tokenizer")
    limit = min(s.engine.config.model.arch.vocab_size, len(tok))
    bad = next((t for t in tokens if not 0 <= t < limit), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range: token ids must be in [0, {limit})", "tokens")
    try:
        return tok.decode(tokens)
    except Exception as e:  # noqa: BLE001
        raise bad_request(f"could not decode the tokens: {type(e).__name__}: {e}", "tokens") from None
