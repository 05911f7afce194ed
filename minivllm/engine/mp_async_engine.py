"""MPAsyncEngine: AsyncEngine's interface with the engine core in a child process.

The HTTP process keeps the tokenizer (prompts are tokenized here, outputs arrive as text) and
one receiver thread; the child (engine_core_proc.py) schedules, runs the model, detokenizes.

    asyncio tasks                     receiver thread                 engine-core process
    add_request ── send("add") ───────────────────────────────────►  add, ack, step, step...
    (await ack)  ◄─ call_soon_threadsafe ◄─ recv("added") ◄──────────
    RequestStream ◄─ call_soon_threadsafe(_apply_outputs) ◄─ recv("out": deltas) ◄─

Invariants:
- A stream sees the same items as with AsyncEngine: cumulative RequestOutputs (independent
  snapshots), ending with exactly one terminal item (the finished output or an exception).
- Deltas are folded into the cumulative state on the stream's own event loop, so a consumer
  never sees a half-applied step; the snapshot is copied when the consumer takes it.
- If the child dies, every open stream and pending add fails with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from minivllm.engine.async_engine import (
    EngineClient,
    EngineClosedError,
    EngineDeadError,
    RequestStream,
    _call_soon,
    _resolve,
)
from minivllm.engine.engine_core_proc import PackedOutput, engine_core_main
from minivllm.engine.input_processor import parse_prompt
from minivllm.engine.step_history import StepHistory
from minivllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    """A request this process is waiting on: its stream and its cumulative output so far."""

    stream: RequestStream
    output: RequestOutput
    future: asyncio.Future | None  # the add's acknowledgement, until it arrives


def startup_exit_message(exitcode: int | None) -> str:
    """Why the engine core is gone before it said it was ready, as far as its exit code tells."""
    msg = f"the engine-core process exited during startup (exit code {exitcode})"
    if exitcode == -signal.SIGKILL:
        msg += (": killed (SIGKILL), most often by the kernel's out-of-memory killer; lower "
                "kv_cache_memory_bytes, gpu_memory_utilization or what else runs on this machine")
    return msg


class MPAsyncEngine(EngineClient):
    """Drop-in for AsyncEngine (same public methods) over a spawned engine-core process."""

    def __init__(self, config, startup_timeout_s: float | None = None) -> None:
        self.config = config
        self.tokenizer = None
        if not config.model.skip_tokenizer_init:
            from minivllm.engine.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(config.model)
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        cmd_recv, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=engine_core_main, name="minivllm-engine-core", daemon=True,
                                 args=(config, cmd_recv, out_send, logging.getLogger().getEffectiveLevel()))
        self._proc.start()
        cmd_recv.close()
        out_send.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _requests (loop threads and the receiver thread)
        self._requests: dict[str, _Tracked] = {}
        self._stopped = False
        self.startup_s, stats = self._wait_ready(startup_timeout_s)
        super().__init__(stats, StepHistory())  # filled from the engine core's "steps" messages
        self._receiver = threading.Thread(target=self._receive, name="minivllm-engine-receiver", daemon=True)
        self._receiver.start()

    @classmethod
    def from_kwargs(cls, **kwargs) -> MPAsyncEngine:
        from minivllm.engine.config_builder import build_engine_config
        return cls(build_engine_config(**kwargs))

    def _wait_ready(self, timeout_s: float | None):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._out.poll(0.2):
            if not self._proc.is_alive():
                raise RuntimeError(startup_exit_message(self._proc.exitcode))
            if deadline is not None and time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the engine-core process did not start within {timeout_s} s")
        try:
            msg = self._out.recv()
        except EOFError:  # its end closed without a word: the process died (poll saw the EOF)
            self._proc.join(10)
            raise RuntimeError(startup_exit_message(self._proc.exitcode)) from None
        if msg[0] == "failed":
            self._proc.join(10)
            raise msg[1]
        return msg[1], msg[2]

    # ---- read-only engine facts --------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # ---- public API (as AsyncEngine) ---------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                          arrival_time: float | None = None, priority: int = 0,
                          lora_request: Any = None) -> RequestStream:
        """Tokenizes here, queues the request in the engine core and returns its stream once
        accepted; raises ValueError (bad input), EngineClosedError or EngineDeadError."""
        self._check_open()
        params.validate()
        parsed = parse_prompt(prompt, self.tokenizer)
        wire_params = params.clone()
        wire_params.output_kind = RequestOutputKind.DELTA
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, self, snapshot=_snapshot)
        future = loop.create_future()
        output = _empty_output(request_id, parsed, params)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._requests[request_id] = _Tracked(stream, output, future)
        arrival = arrival_time if arrival_time is not None else time.time()
        try:
            engine_prompt = {"prompt": parsed.text, "prompt_token_ids": parsed.token_ids}
            if parsed.cache_salt is not None:
                engine_prompt["cache_salt"] = parsed.cache_salt
            self._send(("add", request_id, engine_prompt, wire_params, arrival, priority, lora_request))
            await future
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            with self._lock:
                self._requests.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """From any thread; the engine core frees the blocks before its next step and sends
        the final output (finish_reason 'abort')."""
        try:
            self._send(("abort", request_id))
        except EngineDeadError:
            pass

    def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine core died: {self.dead_error}")
        if not self._proc.is_alive():
            raise EngineDeadError("the engine is shut down")

    @property
    def num_pending_adds(self) -> int:
        with self._lock:
            return sum(t.future is not None for t in self._requests.values())

    def set_block_map_interval(self, interval_s: float | None) -> None:
        self._send(("block_map", interval_s))

    def profile(self, action: str, directory: str | None = None) -> None:
        self._send(("profile", action, directory))  # the engine core traces itself and writes the file

    def pause(self) -> None:
        self._send(("pause",))

    def resume(self) -> None:
        self._send(("resume",))

    def begin_drain(self, grace_s: float) -> None:
        self._accepting = False
        try:
            self._send(("drain", grace_s))
        except EngineDeadError:
            pass

    def shutdown(self, grace_s: float = 0.0, join_timeout_s: float | None = 60.0) -> None:
        """Drain (grace_s), stop the engine core and join it; blocking."""
        self._accepting = False
        if not self._stopped:
            self._stopped = True
            try:
                self._send(("stop", grace_s))
            except EngineDeadError:
                pass
        self._proc.join(join_timeout_s)
        if self._proc.is_alive():
            logger.warning("the engine core did not exit in %s s; killing it", join_timeout_s)
            self._proc.kill()
            self._proc.join(5)
        self._receiver.join(5)

    def _check_open(self) -> None:
        if self.dead_error is not None or not self._proc.is_alive():
            raise EngineDeadError("the engine is not running")
        if not self._accepting:
            raise EngineClosedError("the server is shutting down and accepts no new requests")

    def _send(self, msg) -> None:
        try:
            with self._send_lock:
                self._cmd.send(msg)
        except (OSError, ValueError) as e:  # broken pipe / closed: the child is gone
            raise EngineDeadError(f"the engine core is not reachable: {e}") from None

    # ---- receiver thread ---------------------------------------------------------------------
    def _receive(self) -> None:
        reason = "the engine shut down"
        while True:
            try:
                msg = self._out.recv()
            except (EOFError, OSError):
                if not self._stopped:
                    self._proc.join(0.5)  # (for its exit code)
                    reason = f"the engine core exited unexpectedly (exit code {self._proc.exitcode})"
                    self.dead_error = EngineDeadError(reason)
                break
            kind = msg[0]
            if kind == "out":
                self._stats = msg[2]
                self._dispatch(msg[1])
            elif kind == "steps":
                self.history.add(msg[1], msg[2], msg[3])
            elif kind == "added":
                self._stats = msg[2]
                self._acknowledge(msg[1])
            elif kind == "dead":
                reason = f"the engine core died: {msg[1]}"
                self.dead_error = EngineDeadError(reason)
        self._accepting = False
        self._fail_all(EngineDeadError(reason))  # every in-flight request ends with an error now
        if self.dead_error is not None:
            logger.error("%s", reason)
            self._declare_dead(self.dead_error)

    def _acknowledge(self, results: list[tuple[str, BaseException | None]]) -> None:
        for rid, error in results:
            with self._lock:
                tracked = self._requests.get(rid)
                if tracked is None or tracked.future is None:
                    continue
                future, tracked.future = tracked.future, None
                if error is not None:
                    del self._requests[rid]
            _resolve(future, error)

    def _dispatch(self, packed: list[PackedOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Tracked, PackedOutput]]] = {}
        with self._lock:
            for p in packed:
                tracked = self._requests.pop(p[0], None) if p[1] else self._requests.get(p[0])
                if tracked is not None:
                    by_loop.setdefault(tracked.stream.loop, []).append((tracked, p))
        for loop, items in by_loop.items():
            _call_soon(loop, self._apply_outputs, items)

    def _apply_outputs(self, items: list[tuple[_Tracked, PackedOutput]]) -> None:
        """On the requests' event loop: fold the deltas into the live cumulative outputs (a
        request may have several, from merged steps, in step order), show them to the
        observers, and flag the streams; a stream copies the output only when its consumer
        takes it (a busy consumer skips the steps it missed)."""
        for t, p in items:
            _fold(t.output, p)
        touched = list({id(t): t for t, _ in items}.values())
        self._notify_observers([t.output for t in touched], time.time())
        for t in touched:
            t.stream._put(t.output)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            tracked, self._requests = list(self._requests.values()), {}
        for t in tracked:
            if t.future is not None:
                _resolve(t.future, error)
            else:
                _call_soon(t.stream.loop, t.stream._put, error)


def _empty_output(request_id: str, parsed, params) -> RequestOutput | EmbeddingRequestOutput:
    if isinstance(params, PoolingParams):
        return EmbeddingRequestOutput(request_id, EmbeddingOutput([]), parsed.token_ids, False, parsed.text)
    return RequestOutput(request_id, parsed.text, parsed.token_ids, [], False)


def _fold(acc: RequestOutput | EmbeddingRequestOutput, packed: PackedOutput) -> None:
    """Applies one step's delta to the cumulative output `acc`."""
    _, finished, samples, metrics, num_cached, extra = packed
    if isinstance(acc, EmbeddingRequestOutput):
        acc.outputs.embedding = extra.get("embedding") or acc.outputs.embedding
        acc.finished, acc.num_cached_tokens = finished, num_cached
        if metrics is not None:
            acc.metrics = RequestMetrics(*metrics, num_cached_tokens=num_cached)
        return
    if extra.get("prompt_logprobs") is not None:  # sent once, with the first output that has them
        acc.prompt_logprobs = extra["prompt_logprobs"]
    if extra.get("kv_transfer_params") is not None:
        acc.kv_transfer_params = extra["kv_transfer_params"]
    for index, text, token_ids, cum_logprob, logprobs, finish_reason, stop_reason in samples:
        while len(acc.outputs) <= index:
            acc.outputs.append(CompletionOutput(len(acc.outputs), "", []))
        o = acc.outputs[index]
        o.text += text
        o.token_ids.extend(token_ids)
        if logprobs is not None:
            if o.logprobs is None:
                o.logprobs = []
            o.logprobs.extend(logprobs)
        o.cumulative_logprob, o.finish_reason, o.stop_reason = cum_logprob, finish_reason, stop_reason
    acc.finished = finished
    acc.num_cached_tokens = num_cached
    if metrics is not None:
        acc.metrics = RequestMetrics(*metrics, num_cached_tokens=num_cached)


def _snapshot(acc: RequestOutput | EmbeddingRequestOutput) -> RequestOutput | EmbeddingRequestOutput:
    """An independent copy of the cumulative output (the consumer may keep or change it)."""
    if isinstance(acc, EmbeddingRequestOutput):
        return EmbeddingRequestOutput(acc.request_id, EmbeddingOutput(list(acc.outputs.embedding)),
                                      acc.prompt_token_ids, acc.finished, acc.prompt, acc.metrics, acc.num_cached_tokens)
    outs = [CompletionOutput(o.index, o.text, list(o.token_ids), o.cumulative_logprob,
                             list(o.logprobs) if o.logprobs is not None else None, o.finish_reason, o.stop_reason)
            for o in acc.outputs]
    return RequestOutput(acc.request_id, acc.prompt, acc.prompt_token_ids, outs, acc.finished, metrics=acc.metrics,
                         prompt_logprobs=acc.prompt_logprobs, num_cached_tokens=acc.num_cached_tokens,
                         kv_transfer_params=acc.kv_transfer_params)
