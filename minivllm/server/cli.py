"""`minivllm serve`: the OpenAI-compatible HTTP server on uvicorn.

SIGTERM (or a first Ctrl-C): uvicorn stops accepting connections; the engine stops accepting
requests and lets the in-flight ones run up to --shutdown-timeout seconds, then aborts them
(each client still gets a terminal response); the lifespan joins the engine (thread, or with --engine-process, the default, the
engine-core process); exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal

import uvicorn

from minivllm.engine.args import add_engine_args, engine_kwargs

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    add_server_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("MINIVLLM_API_KEY"),
                   help="require `Authorization: Bearer KEY` on the API routes (default: $MINIVLLM_API_KEY)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) the API accepts as `model`; the first is reported (default: the model's); with "
                        "several --model flags, one name per model, in their order")
    g.add_argument("--models-config", default=None,
                   help="a YAML file naming several models, their memory shares and engine options "
                        "(server/multi_model.py); each gets its own engine and KV pool")
    g.add_argument("--max-queue", type=int, default=None,
                   help="refuse new requests with 429 + Retry-After while N requests are already waiting")
    g.add_argument("--max-tokens-in-flight", type=int, default=None,
                   help="refuse new requests with 429 + Retry-After while the prompt + max_tokens of unfinished "
                        "requests would pass N (default: 8x the KV cache's tokens)")
    g.add_argument("--max-request-body-bytes", type=int, default=8 << 20, help="413 above this body size")
    g.add_argument("--max-prompts-per-request", type=int, default=256, help="prompts in one completions request")
    g.add_argument("--max-n", type=int, default=16, help="largest n (samples per prompt)")
    g.add_argument("--max-stop-sequences", type=int, default=16, help="stop strings per request")
    g.add_argument("--max-logit-bias", type=int, default=1024, help="logit_bias entries per request")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served under their names (with --enable-lora); "
                        "more at run time through POST /v1/load_lora_adapter")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core in its own process (default), so the HTTP process's GIL "
                        "serves clients only; --no-engine-process runs it on a thread of this process")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": the model decides whether to call tools (needs --tool-call-parser)')
    from minivllm.server.tool_parsers import TOOL_PARSERS
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how tool calls are written in the model's output")
    g.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=True,
                   help="serve the live dashboard at /dashboard (behind --api-key; --no-dashboard turns it off)")
    g.add_argument("--profile-dir", default=None,
                   help="enable POST /start_profile and /stop_profile (vLLM's): torch-profiler Chrome traces "
                        "of the engine core, written to this directory")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic engine status line (every $VLLM_LOG_STATS_INTERVAL s, default 10: throughput, "
                        "running/waiting, KV use, prefix hit rate; one per model and per data-parallel replica)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def server_settings(args: argparse.Namespace):
    from minivllm.server.lora import parse_lora_modules
    from minivllm.server.serving_common import ServerSettings
    return ServerSettings(served_model_names=list(args.served_model_name or []), api_key=args.api_key or None,
                          max_queue=args.max_queue, shutdown_grace_s=args.shutdown_timeout,
                          enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                          max_body_bytes=args.max_request_body_bytes, max_prompts_per_request=args.max_prompts_per_request,
                          max_n=args.max_n, max_stop_sequences=args.max_stop_sequences,
                          max_logit_bias=args.max_logit_bias, max_tokens_in_flight=args.max_tokens_in_flight,
                          enable_dashboard=args.dashboard, profile_dir=args.profile_dir,
                          status_log_interval_s=None if args.disable_log_stats else _log_stats_interval(),
                          lora_modules=parse_lora_modules(args.lora_modules))


def _log_stats_interval() -> float:
    """vLLM's VLLM_LOG_STATS_INTERVAL: seconds between two status lines (default 10)."""
    raw = os.environ.get("VLLM_LOG_STATS_INTERVAL", "10")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be a number of seconds > 0, got {raw!r}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    from minivllm.engine.async_engine import AsyncEngine
    from minivllm.engine.gc_heap import freeze_startup_heap
    from minivllm.engine.mp_async_engine import MPAsyncEngine
    from minivllm.server.app import create_app
    from minivllm.server.multi_model import ModelRouter

    settings = server_settings(args)  # bad flag values fail before the model loads
    if settings.status_log_interval_s:
        from minivllm.server.status_log import show_status_lines
        show_status_lines()
    served = _served_models(args, settings)
    engine_cls = MPAsyncEngine if args.engine_process else AsyncEngine
    engines, apps = [], []
    try:
        for kwargs, model_settings in served:
            engines.append(engine_cls.from_kwargs(**kwargs))
            apps.append(create_app(engines[-1], _with_token_cap(model_settings, engines[-1])))
    except BaseException:
        for e in engines:
            e.shutdown(0.0)
        raise
    app = apps[0] if len(apps) == 1 else ModelRouter(apps)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 10, lifespan="on")
    server = DrainingServer(config, on_exit=lambda: [e.begin_drain(settings.shutdown_grace_s) for e in engines])
    for engine in engines:
        engine.add_death_callback(server.stop_for_engine_death)
    freeze_startup_heap()  # the HTTP process's own heap (tokenizer, FastAPI, pydantic models)
    # uvicorn re-raises a caught SIGTERM once it has shut down; a no-op handler makes that a
    # clean exit (status 0) instead of death by signal
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    profile = _http_profiler()
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        for engine in engines:
            engine.shutdown(0.0)  # no-op if the lifespan already did it
        if profile is not None:
            profile.disable()
            profile.dump_stats(os.environ["MINIVLLM_PROFILE_HTTP"])
    if server.engine_died is not None:
        logger.error("exiting with status 1: %s", server.engine_died)
        return 1  # a supervisor (systemd, Kubernetes) restarts the server
    return 0


def _served_models(args: argparse.Namespace, settings) -> list[tuple[dict, object]]:
    """(engine kwargs, server settings) of each model to serve: one, or several (--model given
    several times, or --models-config), each with its own name and memory share."""
    from minivllm.server.multi_model import model_specs
    models = ([args.model_tag] if args.model_tag is not None else []) + list(args.model or [])
    args.model = None
    base = engine_kwargs(args)
    base["serving"] = True  # serving defaults for the scheduler limits (as vLLM's API server)
    names = settings.served_model_names
    if len(models) <= 1 and args.models_config is None:
        kwargs = dict(base, model=models[0] if models else None)
        if names:
            kwargs["served_model_name"] = names[0]
        return [(kwargs, settings)]
    return [(spec.kwargs, dataclasses.replace(settings, served_model_names=[spec.name] if spec.name else []))
            for spec in model_specs(models, args.models_config, base, names)]


def _with_token_cap(settings, engine):
    """Default --max-tokens-in-flight: 8x what the engine's KV cache holds."""
    if settings.max_tokens_in_flight is not None:
        return settings
    stats = engine.get_stats()
    return dataclasses.replace(settings, max_tokens_in_flight=8 * stats.num_kv_blocks * engine.config.cache.block_size)


def _http_profiler():
    """MINIVLLM_PROFILE_HTTP=<file>: cProfile of the HTTP process's event-loop thread (where
    requests, streams and SSE chunks are handled), written at exit; for finding per-chunk costs."""
    if not os.environ.get("MINIVLLM_PROFILE_HTTP"):
        return None
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
    return profile


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that also starts the engine's drain when a shutdown signal arrives."""

    def __init__(self, config, on_exit) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine_died: BaseException | None = None

    def stop_for_engine_death(self, error: BaseException) -> None:
        """The engine died (any thread): every request already got its error; stop serving
        (/health answers 503 until the listener closes) and let cmd_serve exit with status 1."""
        self.engine_died = error
        self.should_exit = True  # uvicorn's main loop polls it

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:  # in a signal handler: hand the work to the event loop
            self._loop.call_soon_threadsafe(self._on_exit)
