"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status.

Every exception that reaches the app is mapped here, so no input can produce FastAPI's default
422 or an HTML/plain 500: invalid input is a 400, and only a bug is a 500 (still with a body).
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from minivllm.engine.async_engine import EngineClosedError, EngineDeadError

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    err_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class JSONResponse(Response):
    """JSON with ASCII escapes: any str (even a lone surrogate echoed from input) encodes."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return dumps(content).encode("ascii")


def dumps(content) -> str:
    return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


_PARAM_RE = re.compile(r"SamplingParams\.(\w+)")


def from_value_error(e: Exception, default_param: str | None = None) -> OpenAIError:
    """An engine ValueError (it names the field and the limit) as a 400."""
    msg = str(e) or type(e).__name__
    m = _PARAM_RE.search(msg)
    param = m.group(1) if m else default_param
    code = "context_length_exceeded" if "max_model_len" in msg or "KV cache" in msg else None
    return bad_request(msg, param, code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        err = errors[0].get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON: {err}".rstrip(": "), None
    parts, first_param = [], None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        first_param = first_param or (loc[0] if loc else None)
        parts.append(f"{where}: {e.get('msg', 'invalid value')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more, first_param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        msg, param = _validation_message(exc)
        return error_response(bad_request(msg, param, "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(OpenAIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))

    @app.exception_handler(EngineClosedError)
    async def _closed(_: Request, exc: EngineClosedError) -> Response:
        return error_response(OpenAIError(503, str(exc), code="shutting_down", headers={"Retry-After": "5"}))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> Response:
        return error_response(OpenAIError(503, str(exc), code="engine_dead"))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("internal error while serving a request")
        return error_response(OpenAIError(500, f"internal server error: {type(exc).__name__}"))
