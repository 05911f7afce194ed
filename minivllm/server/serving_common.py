"""What completions and chat share: settings, model check, admission, submission, waiting
for results while watching for a client disconnect, merging streams, and SSE framing."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from minivllm.engine.async_engine import AsyncEngine, RequestStream
from minivllm.lora.request import LoRARequest
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server.errors import OpenAIError, dumps, from_value_error
from minivllm.server.lora import LoRARegistry

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's served name
    api_key: str | None = None
    max_queue: int | None = None  # refuse new requests while this many are already waiting
    retry_after_s: int = 1
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests get this long, then are aborted
    own_engine: bool = True  # the app's lifespan shuts the engine down
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model decides, the parser finds calls
    tool_call_parser: str | None = None  # hermes | llama3_json
    # what one client may ask for (400 above), so that nothing a client sends makes the server
    # allocate without bound; and the load the server accepts (429 + Retry-After above)
    max_body_bytes: int = 8 << 20
    max_prompts_per_request: int = 256
    max_n: int = 16
    max_stop_sequences: int = 16
    max_logit_bias: int = 1024
    max_tokens_in_flight: int | None = None  # prompt + max_tokens of all unfinished requests; None: no cap
    enable_dashboard: bool = True  # GET /dashboard and /dashboard/events (--no-dashboard)
    dashboard_interval_s: float = 0.5  # how often the dashboard's event stream sends an update
    status_log_interval_s: float | None = 10.0  # the periodic engine status line (None: off)
    profile_dir: str | None = None  # POST /start_profile and /stop_profile write torch traces here
    lora_modules: list[tuple[str, str]] = field(default_factory=list)  # --lora-modules (name, path)

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1 (or None for no limit), got {self.max_queue}")
        if self.tool_call_parser is not None:
            from minivllm.server.tool_parsers import TOOL_PARSERS
            if self.tool_call_parser not in TOOL_PARSERS:
                raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        for name in ("max_body_bytes", "max_prompts_per_request", "max_n", "max_stop_sequences", "max_logit_bias"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens_in_flight is not None and self.max_tokens_in_flight < 1:
            raise ValueError(f"max_tokens_in_flight must be >= 1 (or None), got {self.max_tokens_in_flight}")


class ServingBase:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings, loras: LoRARegistry | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.model_names = settings.served_model_names or [engine.config.model.served_name]
        # LoRA adapters served under their own names (shared by every endpoint of the app)
        self.loras = loras if loras is not None else LoRARegistry(engine.config, self.model_names)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> str:
        """The name to echo back; 404 if the client asked for a model this server doesn't serve."""
        if name is None or name in self.model_names or name in self.loras.adapters:
            return name or self.model_name
        raise OpenAIError(404, f"The model `{name}` does not exist. This server serves: "
                          f"{', '.join(self.model_names + list(self.loras.adapters))}.", "model", "model_not_found")

    def lora_for(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        return self.loras.adapters.get(name) if name is not None else None

    def check_admission(self, new_tokens: int = 0) -> None:
        """429 + Retry-After while the queue is full or the tokens in flight would pass the cap."""
        s, stats = self.settings, self.engine.get_stats()
        waiting = stats.num_waiting + self.engine.num_pending_adds
        if s.max_queue is not None and waiting >= s.max_queue:
            raise self._overloaded(f"{waiting} requests are waiting (--max-queue {s.max_queue})")
        cap = s.max_tokens_in_flight
        if cap is not None and stats.tokens_in_flight + new_tokens > cap:
            raise self._overloaded(f"{stats.tokens_in_flight} tokens are in flight and this request adds "
                                   f"{new_tokens} (--max-tokens-in-flight {cap})")

    def _overloaded(self, why: str) -> OpenAIError:
        return OpenAIError(429, f"the server is overloaded: {why}; retry later", code="server_overloaded",
                           headers={"Retry-After": str(self.settings.retry_after_s)})

    def check_request_limits(self, num_prompts: int, params: SamplingParams) -> None:
        """The per-request caps of ServerSettings (400 naming the field and the limit)."""
        s = self.settings
        for value, limit, field_name in ((num_prompts, s.max_prompts_per_request, "prompt"),
                                         (params.n, s.max_n, "n"),
                                         (len(getattr(params, "stop_strings", ())), s.max_stop_sequences, "stop"),
                                         (len(getattr(params, "logit_bias", None) or {}), s.max_logit_bias,
                                          "logit_bias")):
            if value > limit:
                raise OpenAIError(400, f"{field_name} has {value} entries; this server allows at most {limit}",
                                  field_name, "limit_exceeded")

    async def submit(self, base_id: str, prompts: list, params, priority: int, param_name: str,
                     cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """Adds one engine request per prompt; all or nothing (a refused prompt aborts the rest).
        params: SamplingParams, BeamSearchParams or PoolingParams."""
        self.check_request_limits(len(prompts), params)
        # (a text prompt's length is not known yet: its max_tokens and n count now, its tokens in
        # the engine's figure once added)
        max_tokens = getattr(params, "max_tokens", 0) or 0  # an embedding generates nothing
        self.check_admission(sum(_known_len(p) for p in prompts) + len(prompts) * params.n * max_tokens)
        if cache_salt is not None:
            prompts = [with_cache_salt(p, cache_salt) for p in prompts]
        arrival = time.time()
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.engine.add_request(rid, p, params, arrival, priority, lora_request))
        except ValueError as e:
            _abort_all(streams)
            raise from_value_error(e, param_name) from None
        except (OpenAIError, RuntimeError, asyncio.CancelledError):
            _abort_all(streams)
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the tokenizer refusing odd text: still input
            _abort_all(streams)
            logger.info("prompt refused: %r", e)
            raise OpenAIError(400, f"could not process the prompt: {type(e).__name__}: {e}", param_name) from None
        return streams


def _known_len(prompt) -> int:
    return len(prompt.get("prompt_token_ids") or ()) if isinstance(prompt, dict) else 0


def with_cache_salt(prompt, salt: str) -> dict:
    """An engine prompt (text or dict) as a dict carrying the request's cache_salt."""
    return dict(prompt, cache_salt=salt) if isinstance(prompt, dict) else {"prompt": prompt, "cache_salt": salt}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def sse_body(chunks: AsyncIterator[str], streams: list[RequestStream]) -> AsyncIterator[str]:
    """How every SSE response ends: `[DONE]` after the chunks; an error raised once the status line
    is sent goes into the stream; the requests are aborted whatever happens (a no-op when they
    finished), so a client that disconnects frees its blocks."""
    try:
        async for chunk in chunks:
            yield chunk
        yield SSE_DONE
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
        yield sse_error(e)
        yield SSE_DONE
    finally:
        _abort_all(streams)


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished  # a stream ends with its finished output or raises
    return last


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body was already read by FastAPI)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_or_abort(request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
    """Final outputs of all streams, or None if the client disconnected first (then every
    request is aborted, which frees its KV blocks at the engine's next step)."""
    work = asyncio.ensure_future(asyncio.gather(*(_last(s) for s in streams)))
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        logger.info("client disconnected; aborting %s", [s.request_id for s in streams])
        return None
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            work.add_done_callback(_retrieve)  # no "exception was never retrieved" noise
        _abort_all(streams)


def _retrieve(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they come; the first error is raised."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, None, e))
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def sse(payload: dict) -> str:
    return f"data: {dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: Exception) -> str:
    status = e.status if isinstance(e, OpenAIError) else 500
    message = e.message if isinstance(e, OpenAIError) else f"generation failed: {e}"
    return sse(OpenAIError(status, message).body())


def check_no_internal_error(outputs: list[RequestOutput]) -> None:
    """A sample that ended with finish_reason 'error' hit an engine failure, not bad input."""
    for out in outputs:
        if any(o.finish_reason == "error" for o in out.outputs):
            raise OpenAIError(500, "the engine failed while generating this request")


def kv_transfer_field(outputs: list[RequestOutput]) -> dict:
    """A prefill instance's response carries its kv_transfer_params (vLLM's field); else nothing."""
    params = outputs[0].kv_transfer_params if len(outputs) == 1 else None
    return {} if params is None else {"kv_transfer_params": params}


def stream_usage(req, prompt_tokens: int, completion_tokens: int) -> dict:
    """stream_options.continuous_usage_stats: the usage so far on every chunk (as vLLM does);
    else nothing."""
    so = req.stream_options
    if so is None or not so.continuous_usage_stats:
        return {}
    return {"usage": usage(prompt_tokens, completion_tokens)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
