"""The engine core in its own process (the server's default): the LLMEngine steps there, so
the HTTP process's GIL serves clients only. The client side is mp_async_engine.MPAsyncEngine.

    HTTP process                                engine-core process (this module)
    ────────────                                ─────────────────────────────────
    MPAsyncEngine ── cmd pipe ─────────────►   inbox thread: recv() into a deque
      add / abort / pause / drain / stop        main thread: apply commands, step(), send
    receiver thread ◄── out pipe ───────────   outbox thread: ("added", results, stats),
                                                 ("out", outputs, stats)

Invariants:
- Requests run with RequestOutputKind.DELTA: each step sends only what is new, as compact
  tuples (see `pack_output`); the client rebuilds the cumulative outputs.
- An add is acknowledged ("added") before any output of that request is sent: messages leave
  in the order the loop queued them.
- The step loop never blocks on the out pipe: an outbox thread sends, and when the HTTP process
  falls behind, the "out" messages queued meanwhile leave merged into one (their deltas in
  step order), so a busy client gets fewer, larger messages instead of stalling the GPU.
- The process ignores SIGINT/SIGTERM: the HTTP process decides when it stops (drain, then
  "stop"). If the HTTP process dies, the command pipe reaches EOF and everything is aborted.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque

from minivllm.engine.errors import EngineDeadError
from minivllm.engine.profiler import apply_profile_command
from minivllm.outputs import EmbeddingRequestOutput, RequestOutput

logger = logging.getLogger(__name__)

# one request's new state after a step:
#   (request_id, finished, samples, metrics, num_cached_tokens)
#   samples: [(index, new_text, new_token_ids, cumulative_logprob, new_logprobs, finish_reason, stop_reason)]
#   metrics: (arrival, first_scheduled, first_token, last_token, finished) times or None
PackedOutput = tuple


def pack_output(out: RequestOutput | EmbeddingRequestOutput) -> PackedOutput:
    """(request id, finished, samples, metrics, cached tokens, extra): extra holds an embedding
    request's vector, or a request's prompt logprobs (DELTA outputs carry them once)."""
    m = out.metrics
    metrics = None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                      m.last_token_time, m.finished_time)
    if isinstance(out, EmbeddingRequestOutput):
        return out.request_id, out.finished, [], metrics, out.num_cached_tokens, {"embedding": out.outputs.embedding}
    samples = [(o.index, o.text, o.token_ids, o.cumulative_logprob, o.logprobs, o.finish_reason, o.stop_reason)
               for o in out.outputs]
    extra = {} if out.prompt_logprobs is None else {"prompt_logprobs": out.prompt_logprobs}
    if out.kv_transfer_params is not None:
        extra["kv_transfer_params"] = out.kv_transfer_params
    return out.request_id, out.finished, samples, metrics, out.num_cached_tokens, extra


def portable_error(e: BaseException) -> BaseException:
    """An exception that survives pickling: ValueError stays a ValueError (bad input -> 400)."""
    if isinstance(e, ValueError):
        return ValueError(str(e))
    return RuntimeError(f"{type(e).__name__}: {e}")


def engine_core_main(config, cmd_conn, out_conn, log_level: int) -> None:
    """Process entry point: build the engine, report ready (or the error), serve commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine-core] %(name)s: %(message)s")
    from minivllm.engine.llm_engine import make_engine
    try:
        engine = make_engine(config)
    except BaseException as e:  # noqa: BLE001 - the parent must hear why startup failed
        logger.exception("engine startup failed")
        out_conn.send(("failed", portable_error(e)))
        return
    EngineCore(engine, cmd_conn, out_conn).run()


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies, whatever killed the parent (the
    command pipe's end-of-file does the same more gently, but only once the step in hand is over);
    no engine core outlives its server holding the GPU."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        logger.warning("could not ask to be killed with the parent (prctl)")


class _Inbox:
    """Reads the command pipe on its own thread, so the parent's sends never block on a step."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._cond = threading.Condition()
        self._items: deque = deque()
        threading.Thread(target=self._read, name="engine-core-inbox", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                msg = ("parent_gone",)
            with self._cond:
                self._items.append(msg)
                self._cond.notify()
            if msg[0] in ("parent_gone", "stop"):
                return

    def take(self, timeout: float | None) -> list:
        """All queued commands; waits up to `timeout` s for one (0: don't wait)."""
        with self._cond:
            if not self._items and timeout:
                self._cond.wait(timeout)
            items = list(self._items)
            self._items.clear()
        return items


class _Outbox:
    """Sends the loop's messages on its own thread, in order; adjacent "out" messages that queue
    up while a send is under way are merged (deltas concatenated, newest stats kept)."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._cond = threading.Condition()
        self._items: deque = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._write, name="engine-core-outbox", daemon=True)
        self._thread.start()

    def put(self, msg) -> None:
        with self._cond:
            self._items.append(msg)
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Sends what is queued, then stops the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                batch = list(self._items)
                self._items.clear()
            try:
                for msg in merge_outputs(batch):
                    self._conn.send(msg)
            except (OSError, EOFError, ValueError):
                return  # the parent is gone: the inbox sees EOF and the loop winds down


def merge_outputs(msgs: list) -> list:
    """Adjacent ("out", outputs, stats) messages as one; every other message keeps its place."""
    merged: list = []
    for msg in msgs:
        if msg[0] == "out" and merged and merged[-1][0] == "out":
            merged[-1] = ("out", merged[-1][1] + msg[1], msg[2])
        else:
            merged.append(msg)
    return merged


class _StepLog:
    """MINIVLLM_STEP_LOG=<path>: one JSON line per engine step (host phase seconds, sizes), for
    finding where a served step's time goes. Off unless the variable is set."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "w", buffering=1 << 20)  # noqa: SIM115 - lives as long as the loop

    @classmethod
    def from_env(cls) -> _StepLog | None:
        path = os.environ.get("MINIVLLM_STEP_LOG")
        return cls(path) if path else None

    def write(self, t_start: float, t_end: float, fields: dict) -> None:
        self._file.write(json.dumps({"t": round(t_start, 6), "wall": round(t_end - t_start, 6), **fields}) + "\n")

    def close(self) -> None:
        self._file.close()


class EngineCore:
    """The command/step loop around one LLMEngine (the engine thread of AsyncEngine, as a process)."""

    IDLE_WAIT_S = 1.0
    HISTORY_SEND_S = 0.1  # new step records go to the HTTP process at most this often

    def __init__(self, engine, cmd_conn, out_conn) -> None:
        self.engine = engine
        self.inbox = _Inbox(cmd_conn)
        self.out = _Outbox(out_conn)
        self.step_log = _StepLog.from_env()
        self.paused = False
        self.stopping = False
        self.drain_deadline: float | None = None  # monotonic; abort everything left after it
        self._history_sent = (0, 0.0)  # next step to send, monotonic time of the last send

    def run(self) -> None:
        self.out.put(("ready", self.engine.startup_s, self.engine.get_stats()))
        try:
            while True:
                busy = self.engine.has_unfinished_requests() and not self.paused
                added = self._apply(self.inbox.take(0 if busy else self._wait_s()))
                self._abort_after_deadline()
                if self.stopping:
                    self.engine.release_held_kv()  # (else a prefill instance waits for pulls that may never come)
                if self.stopping and not self.engine.has_unfinished_requests():
                    break
                if added:
                    self.out.put(("added", added, self.engine.get_stats()))
                if self.engine.has_unfinished_requests() and not self.paused:
                    self._step()
                else:
                    self._send_history(force=True)  # the last steps before going idle
                    if not added:
                        self._check_health()
        except BaseException as e:  # noqa: BLE001 - report whatever killed the loop
            logger.exception("engine core died")
            self.out.put(("dead", f"{type(e).__name__}: {e}"))
            return
        finally:
            self.engine.shutdown()
            if self.step_log is not None:
                self.step_log.close()
            self.out.put(("exited",))
            self.out.close()

    def _step(self) -> None:
        t0 = time.perf_counter()
        outputs = self.engine.step()
        t1 = time.perf_counter()
        self.out.put(("out", [pack_output(o) for o in outputs], self.engine.get_stats()))
        self._send_history(force=not self.engine.has_unfinished_requests())
        if self.step_log is not None:
            self.step_log.write(t0, time.perf_counter(), {"pack": time.perf_counter() - t1, **self.engine.last_step})
        if self.engine.dead_error is not None:  # a rank died: its requests' error outputs are sent above
            raise self.engine.dead_error

    def _send_history(self, force: bool = False) -> None:
        """The step records since the last send (with the latest batch and block map), at most
        every HISTORY_SEND_S: one message per interval, whatever the step rate."""
        next_step, last = self._history_sent
        now = time.monotonic()
        history = self.engine.history
        if history.next_step == next_step or (now - last < self.HISTORY_SEND_S and not force):
            return
        snap = history.since(next_step)
        self.out.put(("steps", snap.records, snap.last_batch, snap.block_map))
        self._history_sent = (history.next_step, now)

    def _check_health(self) -> None:
        """Idle: a rank that died meanwhile fails the engine now, not at the next request."""
        try:
            self.engine.check_health()
        except EngineDeadError:
            self._step()  # sends the error outputs of whatever was left, then raises the engine's error

    def _wait_s(self) -> float:
        if self.drain_deadline is None:
            return self.IDLE_WAIT_S
        return max(0.001, min(self.IDLE_WAIT_S, self.drain_deadline - time.monotonic()))

    def _apply(self, commands: list) -> list[tuple[str, BaseException | None]]:
        """Applies commands in order; returns the adds' results [(request_id, error or None)]."""
        added = []
        for cmd in commands:
            kind = cmd[0]
            if kind == "add":
                added.append((cmd[1], self._add(*cmd[1:])))
            elif kind == "abort":
                self.engine.abort_request(cmd[1])
            elif kind == "profile":
                apply_profile_command(self.engine, cmd[1], cmd[2])
            elif kind == "block_map":  # the dashboard wants the KV block map every cmd[1] s
                self.engine.history.block_map_interval_s = cmd[1]
            elif kind == "pause":
                self.paused = True
            elif kind == "resume":
                self.paused = False
            elif kind == "drain":
                self._begin_drain(cmd[1])
            elif kind == "stop":
                self._begin_drain(cmd[1])
                self.stopping = True
            elif kind == "parent_gone":  # nobody can read the outputs any more
                self.engine.abort_request(self.engine.unfinished_request_ids())
                self._begin_drain(0.0)
                self.stopping = True
        return added

    def _add(self, request_id, prompt, params, arrival_time, priority, lora_request=None) -> BaseException | None:
        """prompt: {"prompt": text, "prompt_token_ids": [...], "cache_salt"?}, tokenized by the client."""
        try:
            self.engine.add_request(request_id, prompt, params, arrival_time, priority, lora_request)
        except Exception as e:  # noqa: BLE001 - bad input goes back to the caller
            return portable_error(e)
        return None

    def _begin_drain(self, grace_s: float) -> None:
        deadline = time.monotonic() + max(grace_s, 0.0)
        if self.drain_deadline is None or deadline < self.drain_deadline:
            self.drain_deadline = deadline
        self.paused = False

    def _abort_after_deadline(self) -> None:
        if self.drain_deadline is None or time.monotonic() < self.drain_deadline:
            return
        ids = self.engine.unfinished_request_ids()
        if ids:
            logger.warning("drain deadline reached: aborting %d request(s)", len(ids))
            self.engine.abort_request(ids)
