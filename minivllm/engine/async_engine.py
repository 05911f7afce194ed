"""AsyncEngine: the synchronous LLMEngine driven by one background thread, for asyncio callers.

    asyncio tasks (any number, any event loop)            engine thread (exactly one)
    ─────────────────────────────────────────             ───────────────────────────────
    add_request() ──► command deque ──(Condition)──►  apply commands: add / abort / drain
    abort()       ──►                                  step() while there is work, else wait
    RequestStream ◄── loop.call_soon_threadsafe ◄───  publish this step's RequestOutputs

Invariants:
- Only the engine thread calls the LLMEngine (it is not thread-safe); other threads only push
  commands under the condition's lock and read `get_stats()`'s snapshot (replaced whole).
- Every stream ends with exactly one terminal item: a finished RequestOutput (stop, length,
  abort, error) or an exception (the request was refused, or the engine thread died).
- Outputs are cumulative, so a stream keeps only the newest one: a slow consumer skips
  intermediate states but never misses the final one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.errors import EngineClosedError, EngineDeadError
from minivllm.engine.llm_engine import EngineStats, LLMEngine
from minivllm.engine.profiler import apply_profile_command
from minivllm.engine.step_history import StepHistory
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OutputObserver = Callable[[list[RequestOutput], float], None]  # (this step's outputs, time.time())


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative RequestOutputs.

    Filled from the engine thread through `loop.call_soon_threadsafe`; read on `loop`.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, engine: AsyncEngine,
                 snapshot: Callable[[RequestOutput], RequestOutput] | None = None) -> None:
        self.request_id = request_id
        self.loop = loop
        self._engine = engine
        # MPAsyncEngine puts its live cumulative output and passes the copy function here: the
        # copy is made once per item the consumer takes, not once per engine step
        self._snapshot = snapshot
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False  # a terminal item was handed to the consumer

    # ---- engine side (runs on self.loop) ---------------------------------------------------
    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._latest = item  # cumulative: the newest output supersedes the pending one
        self._event.set()

    # ---- consumer side ---------------------------------------------------------------------
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._latest is None and self._error is None:
            self._event.clear()
            await self._event.wait()
        if self._latest is None:
            self.finished = True
            raise self._error  # type: ignore[misc]
        out, self._latest = self._latest, None
        if self._snapshot is not None:
            out = self._snapshot(out)
        self.finished = out.finished
        return out

    def abort(self) -> None:
        """Aborts the request unless it already ended; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


@dataclass
class _Add:
    stream: RequestStream
    prompt: Any
    params: SamplingParams
    arrival_time: float | None
    priority: int
    future: asyncio.Future
    lora_request: Any = None


@dataclass
class _Commands:
    adds: list[_Add] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    profile: list[tuple[str, str | None]] = field(default_factory=list)  # ("start" | "stop", directory)


class EngineClient:
    """What AsyncEngine and MPAsyncEngine share around their own add_request/abort: the output
    iterator, the stats snapshot, acceptance, and the output observers."""

    def __init__(self, stats: EngineStats, history: StepHistory) -> None:
        self._stats = stats  # replaced whole by the engine side; read from any thread
        # per-step statistics (engine/step_history.py): the engine's own ring, or a mirror of it
        self.history = history
        self._observers: list[OutputObserver] = []
        self._observers_lock = threading.Lock()
        self._accepting = True
        self.dead_error: BaseException | None = None
        self._death_callbacks: list = []

    def add_death_callback(self, fn) -> None:
        """fn(error) runs once, on the engine's own thread, when the engine dies (not on a clean
        shutdown): `minivllm serve` then stops and exits non-zero, so a supervisor restarts it."""
        self._death_callbacks.append(fn)

    def _declare_dead(self, error: BaseException) -> None:
        if self.dead_error is None:
            self.dead_error = error
        for fn in self._death_callbacks:
            try:
                fn(error)
            except Exception:  # noqa: BLE001 - a callback bug must not hide the death
                logger.exception("engine death callback failed")

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                          arrival_time: float | None = None, priority: int = 0,
                          lora_request: Any = None) -> RequestStream:
        """params: SamplingParams, BeamSearchParams or PoolingParams (as LLMEngine.add_request)."""
        raise NotImplementedError

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str,
                       arrival_time: float | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs until the finished one; closing the iterator early aborts."""
        stream = await self.add_request(request_id, prompt, params, arrival_time, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def get_stats(self) -> EngineStats:
        """The engine's counters as of its last step (a snapshot; never blocks on a step)."""
        return self._stats

    def set_block_map_interval(self, interval_s: float | None) -> None:
        """Have the engine take a KV block map into `history` every interval_s (None: never)."""
        raise NotImplementedError

    def profile(self, action: str, directory: str | None = None) -> None:
        """Starts ("start") or stops ("stop", writing the Chrome trace to `directory`) a
        torch-profiler trace of the engine (and, in its own process, of the engine core)."""
        raise NotImplementedError

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.dead_error is None

    def add_output_observer(self, fn: OutputObserver) -> None:
        """fn(outputs, now) runs after each step, before the streams see the outputs (e.g.
        metrics); must be quick and must not keep the outputs (MPAsyncEngine passes its live
        cumulative outputs, which later steps change). AsyncEngine calls it on its engine
        thread, MPAsyncEngine on the requests' event loop."""
        with self._observers_lock:
            self._observers = [*self._observers, fn]  # copy on write: the caller iterates unlocked

    def remove_output_observer(self, fn: OutputObserver) -> None:
        with self._observers_lock:
            self._observers = [f for f in self._observers if f != fn]

    def _notify_observers(self, outputs: list[RequestOutput], now: float) -> None:
        for fn in self._observers:
            try:
                fn(outputs, now)
            except Exception:  # noqa: BLE001 - an observer bug must not kill serving
                logger.exception("output observer failed")


class AsyncEngine(EngineClient):
    """Thread-safe, asyncio-facing wrapper of one LLMEngine (see the module docstring)."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 1.0, own_engine: bool = True) -> None:
        super().__init__(engine.get_stats(), engine.history)
        self.engine = engine
        self._own_engine = own_engine  # shutdown() also shuts the LLMEngine down
        self._cond = threading.Condition()
        self._commands: deque[_Add | tuple[str, str]] = deque()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._drain_deadline: float | None = None  # monotonic; abort everything left after it
        self._stop = False
        self._paused = False
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_kwargs(cls, **kwargs) -> AsyncEngine:
        return cls(LLMEngine.from_kwargs(**kwargs))

    # ---- read-only engine facts (immutable after construction: safe from any thread) ---------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def config(self):
        return self.engine.config

    # ---- public API --------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                          arrival_time: float | None = None, priority: int = 0,
                          lora_request: Any = None) -> RequestStream:
        """Queues a request and returns its stream once the engine accepted it.

        Raises ValueError (bad input, from LLMEngine.add_request), EngineClosedError (draining)
        or EngineDeadError. If the caller is cancelled meanwhile, the request is aborted.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, self)
        future = loop.create_future()
        with self._cond:
            self._check_open()
            self._commands.append(_Add(stream, prompt, params, arrival_time, priority, future, lora_request))
            self._cond.notify()
        try:
            await future
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Aborts a request from any thread; its KV blocks are freed when the engine thread
        applies the command (before its next step). Unknown or finished ids are ignored."""
        with self._cond:
            if self._stop and not self._thread.is_alive():
                return
            self._commands.append(("abort", request_id))
            self._cond.notify()

    def profile(self, action: str, directory: str | None = None) -> None:
        """Starts ("start") or stops ("stop": the trace goes to `directory`) a torch-profiler
        trace on the engine thread, between two steps."""
        with self._cond:
            self._commands.append(("profile", action, directory))
            self._cond.notify()

    def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine thread died: {self.dead_error!r}")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")

    @property
    def num_pending_adds(self) -> int:
        """Requests submitted but not yet handed to the engine (they will wait too)."""
        with self._cond:
            return sum(isinstance(c, _Add) for c in self._commands)

    def set_block_map_interval(self, interval_s: float | None) -> None:
        self.engine.history.block_map_interval_s = interval_s  # (one attribute: read once per step)

    def pause(self) -> None:
        """Stops stepping (requests are still accepted and wait); resume() continues."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def begin_drain(self, grace_s: float) -> None:
        """Stops accepting requests; the ones in flight may run grace_s more seconds, then
        they are aborted (each gets a final output with finish_reason 'abort')."""
        with self._cond:
            self._accepting = False
            deadline = time.monotonic() + max(grace_s, 0.0)
            if self._drain_deadline is None or deadline < self._drain_deadline:
                self._drain_deadline = deadline
            self._paused = False
            self._cond.notify()

    def shutdown(self, grace_s: float = 0.0, join_timeout_s: float | None = 60.0) -> None:
        """Graceful stop: no new requests, in-flight ones finish within grace_s or are aborted,
        then the engine thread exits and is joined. Blocking: call via asyncio.to_thread."""
        self.begin_drain(grace_s)
        with self._cond:
            self._stop = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(join_timeout_s)
        if not self._thread.is_alive() and self._own_engine:
            self.engine.shutdown()

    def _check_open(self) -> None:
        if self.dead_error is not None or (self._stop and not self._thread.is_alive()):
            raise EngineDeadError("the engine is not running")
        if not self._accepting:
            raise EngineClosedError("the server is shutting down and accepts no new requests")

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                commands = self._wait_for_work()
                if commands is None:
                    break
                self._apply(commands)
                self._abort_after_deadline()
                if self._stop:
                    self.engine.release_held_kv()  # (else a prefill instance waits for pulls that may never come)
                if commands.adds:
                    self._stats = self.engine.get_stats()  # new requests count as waiting at once
                stepped = not self._paused and self.engine.has_unfinished_requests()
                outputs = self.engine.step() if stepped else None
                # refreshed before publishing: whoever sees an output sees stats at least as new
                self._stats = self.engine.get_stats()
                if stepped:
                    self._publish(outputs)
                if self.engine.dead_error is not None:  # its requests got their error outputs above
                    raise self.engine.dead_error
        except BaseException as e:  # noqa: BLE001 - the thread must report, whatever happened
            logger.exception("engine thread died")
            # dead before the streams fail: a caller woken by its stream's error that sends a new
            # request must get EngineDeadError, not "shutting down" (_fail_all closes admission)
            if self.dead_error is None:
                self.dead_error = e
            self._fail_all(EngineDeadError(f"the engine thread died: {e!r}"))
            self._declare_dead(e)
            return
        self._fail_all(EngineDeadError("the engine shut down"))

    def _wait_for_work(self) -> _Commands | None:
        """Blocks until there is a command or a step to run; None means: exit the thread."""
        with self._cond:
            while True:
                busy = self.engine.has_unfinished_requests() and not self._paused
                if self._commands or busy:
                    break
                if self._stop and not self.engine.has_unfinished_requests():
                    return None
                self._cond.wait(self._wait_timeout())
                self._maybe_expire_drain()
                self.engine.check_health()  # idle: a rank that died fails the engine now (raises)
            items = list(self._commands)
            self._commands.clear()
        cmds = _Commands()
        for c in items:
            if isinstance(c, _Add):
                cmds.adds.append(c)
            elif c[0] == "profile":
                cmds.profile.append((c[1], c[2]))
            else:
                cmds.aborts.append(c[1])
        return cmds

    def _wait_timeout(self) -> float:
        if self._drain_deadline is None:
            return self._idle_wait_s
        return max(0.0, min(self._idle_wait_s, self._drain_deadline - time.monotonic()))

    def _maybe_expire_drain(self) -> None:
        # a paused engine past its drain deadline must still wake up to abort and exit
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
            self._paused = False

    def _apply(self, cmds: _Commands) -> None:
        for add in cmds.adds:
            self._apply_add(add)
        if cmds.aborts:
            self.engine.abort_request(cmds.aborts)
        for action, directory in cmds.profile:
            apply_profile_command(self.engine, action, directory)

    def _apply_add(self, add: _Add) -> None:
        rid = add.stream.request_id
        try:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self.engine.add_request(rid, add.prompt, add.params, add.arrival_time, add.priority, add.lora_request)
        except Exception as e:  # noqa: BLE001 - input errors go back to the caller, not up
            _resolve(add.future, e)
            return
        self._streams[rid] = add.stream
        _resolve(add.future, None)

    def _abort_after_deadline(self) -> None:
        if self._drain_deadline is None or time.monotonic() < self._drain_deadline:
            return
        if self._streams:
            logger.warning("drain deadline reached: aborting %d request(s)", len(self._streams))
            self.engine.abort_request(list(self._streams))
            self._paused = False

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        self._notify_observers(outputs, time.time())
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            pending = [c for c in self._commands if isinstance(c, _Add)]
            self._commands.clear()
            self._accepting = False
        for add in pending:
            _resolve(add.future, error)
        streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            _call_soon(s.loop, _deliver, [(s, error)])


def _deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream._put(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the consumer's event loop is closed: nobody is listening
        pass


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    def settle() -> None:
        if future.done():  # the caller was cancelled; it aborts the request itself
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    _call_soon(future.get_loop(), settle)
