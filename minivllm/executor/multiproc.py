"""The mp executor: one worker process per rank on this machine (executor/worker.py).

    engine core ── Listener (127.0.0.1, random port, random key) ◄── connect ── worker rank r
      launch: pickle ("step", SchedulerOutput, bitmask or None) once, send the same bytes to every rank
      finish: wait for the driver's ("out", RunnerOutput), watching every other rank meanwhile;
              with async scheduling, first send ("finish",) if no later step was launched (a
              worker finishes a step when the next one arrives, or when told to)
      profile: ("profile", "start" | "stop", trace path) to every rank, in order with the steps;
               each rank traces itself and writes its file (no answer)

Workers are plain `python -m minivllm.executor.worker` processes (not multiprocessing children:
an engine core that is itself a daemonic process may start them, and nothing waits on them at
interpreter exit). Torch's collectives rendezvous on another free local port.

A rank that dies (its connection closes) or reports an error makes launch/finish/check_health
raise ExecutorDeadError; shutdown() (also run when the executor is garbage collected or the
interpreter exits) stops the workers, then kills whatever is left.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Listener, wait

from minivllm.config import EngineConfig
from minivllm.core.interfaces import RunnerOutput, SchedulerOutput
from minivllm.executor.errors import DeathLatch
from minivllm.executor.worker import AUTHKEY_ENV
from minivllm.structured.bitmask import GrammarBitmask

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading and sizing a large model on every rank
STOP_TIMEOUT_S = 10.0
POLL_S = 1.0  # how often a waiting executor checks that every worker process still runs


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MultiprocExecutor(DeathLatch):
    _name = "mp executor"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.parallel.world_size
        p = config.parallel
        # the driver: the last pipeline stage's first tensor-parallel rank
        self.driver = (p.pipeline_parallel_size - 1) * p.tensor_parallel_size
        self._procs: list[subprocess.Popen] = []
        self._conns: list = []
        self._launched = self._finished = 0
        # async scheduling: a worker finishes its step in flight only when the next step arrives
        # (launched first, so the device never waits) or when told to ("finish"), see finish()
        self._overlap = config.async_scheduling
        self._expert_counts: list[list[int]] | None = None  # the driver's latest, [MoE layers][experts]
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, self._conns)
        atexit.register(self._finalizer)
        try:
            self._start()
            self.num_blocks = self._startup()
        except BaseException:
            self.shutdown()
            raise
        logger.info("mp executor: %d worker processes (tp=%d, pp=%d), %d KV blocks each", self.world_size,
                    p.tensor_parallel_size, p.pipeline_parallel_size, self.num_blocks)

    # ---- startup -----------------------------------------------------------------------------
    def _start(self) -> None:
        key = os.urandom(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        env = {**os.environ, AUTHKEY_ENV: key.hex()}
        host, port = listener.address
        for rank in range(self.world_size):
            self._procs.append(subprocess.Popen([sys.executable, "-m", "minivllm.executor.worker", host, str(port),
                                                 str(rank)], env=env, stdin=subprocess.DEVNULL))
        by_rank = self._accept(listener)
        self._conns.extend(by_rank[r] for r in range(self.world_size))
        # replicas in one world (expert parallelism across them) meet on the port their engine chose
        port = self.config.parallel.data_parallel_master_port if self.config.parallel.spans_replicas else None
        init_method = f"tcp://127.0.0.1:{port or free_port()}"
        cores = os.cpu_count() or 1
        threads = max(1, cores // self.world_size)  # (CPU) the ranks share the cores
        level = logging.getLogger().getEffectiveLevel()
        for conn in self._conns:
            conn.send(("init", self.config, init_method, threads, level))

    def _accept(self, listener: Listener) -> dict[int, object]:
        """Every worker's connection, by rank; raises if a worker exits first."""
        by_rank: dict[int, object] = {}
        errors: list[BaseException] = []

        def accept() -> None:
            try:
                while len(by_rank) < self.world_size:
                    conn = listener.accept()
                    _, rank, _pid = conn.recv()
                    by_rank[rank] = conn
            except BaseException as e:  # noqa: BLE001 - reported by the waiting thread
                errors.append(e)

        thread = threading.Thread(target=accept, name="minivllm-executor-accept", daemon=True)
        thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        try:
            while thread.is_alive():
                thread.join(0.1)
                self._check_procs("starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the worker processes did not connect within {STARTUP_TIMEOUT_S} s")
        finally:
            listener.close()
        if errors:
            raise RuntimeError(f"worker startup failed: {errors[0]!r}")
        return by_rank

    def _startup(self) -> int:
        """Every rank loads its shard and sizes its KV budget; all allocate the smallest."""
        num_blocks = min(self._gather("planned"))
        for conn in self._conns:
            conn.send(("kv", num_blocks))
        # each rank's startup objects, frozen out of its full GC passes (Worker.init_kv)
        self.rank_frozen_objects: list[int] = self._gather("ready")
        return num_blocks

    def _gather(self, kind: str) -> list:
        """One `kind` message from every rank (in any order); their payloads by rank."""
        got: dict[int, object] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(got) < self.world_size:
            for r, msg in self._poll(deadline):
                if msg[0] == "error":
                    raise RuntimeError(f"worker rank {r} failed during startup:\n{msg[1]}")
                assert msg[0] == kind and r not in got, (r, msg[0], kind)
                got[r] = msg[1] if len(msg) > 1 else None
        return [got[r] for r in range(self.world_size)]

    # ---- steps -------------------------------------------------------------------------------
    def launch(self, sched: SchedulerOutput, grammar: GrammarBitmask | None = None) -> int:
        """Send the step to every rank (one pickle, the same bytes to each); returns its number.
        grammar: the bitmask of the step's constrained rows (every rank applies it to the same
        gathered logits, so every rank samples the same tokens)."""
        self._raise_if_dead()
        self._send_all(("step", sched, grammar))
        self._launched += 1
        return self._launched

    def launch_forward(self, sched: SchedulerOutput) -> SchedulerOutput:
        """A step with constrained rows: nothing is sent until its bitmask is known (the
        workers run forward and sampling as one message)."""
        return sched

    def launch_sampling(self, forward: SchedulerOutput, grammar: GrammarBitmask | None = None) -> int:
        return self.launch(forward, grammar)

    @property
    def num_launched(self) -> int:
        """Steps launched so far (with replicas in lock-step: one forward on every rank each)."""
        return self._launched

    def run_idle_step(self) -> None:
        """A step with nothing scheduled: with replicas in lock-step (expert parallelism across
        them) every rank still joins the MoE layers' all_to_alls (runner: model.idle_step)."""
        self.finish(self.launch(SchedulerOutput()))

    def kill_workers(self) -> None:
        """Kill every worker process (a peer replica died: these may wait for it in a collective);
        the step waiting on them then fails with ExecutorDeadError in its own thread."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()

    def expert_token_counts(self) -> tuple[int, ...] | None:
        """A MoE model's tokens routed to each expert (summed over its layers), as the driver
        last sent them (about once a second, with a step's output); None for a dense model."""
        if self._expert_counts is None:
            return None
        return tuple(sum(col) for col in zip(*self._expert_counts))

    def expert_token_counts_per_layer(self) -> list[list[int]] | None:
        """The driver's per-layer counts [MoE layers][experts], read now (between steps: none may
        be in flight); None for a dense model."""
        assert self._finished == self._launched, "expert counts are read between steps"
        self._raise_if_dead()
        try:
            self._conns[self.driver].send_bytes(pickle.dumps(("expert_counts",)))
        except (OSError, ValueError) as e:
            self._fail(f"a worker's connection is closed ({e})")
        msg = self._recv(self.driver)
        if msg[0] == "error":
            self._fail(f"worker rank {self.driver} raised:\n{msg[1]}")
        self._expert_counts = msg[1] if msg[1] is not None else self._expert_counts
        return msg[1]

    def start_rank_profiles(self) -> None:
        """Every rank starts a torch-profiler trace before its next step (engine/profiler.py)."""
        self._send_all(("profile", "start", None))

    def stop_rank_profiles(self, paths: list[str]) -> None:
        """Every rank stops its trace after the steps sent so far and writes it to paths[rank];
        nothing is awaited (the files appear once written)."""
        self._raise_if_dead()
        for conn, path in zip(self._conns, paths):
            self._send_to(conn, pickle.dumps(("profile", "stop", path)))

    def _send_all(self, msg) -> None:
        self._raise_if_dead()
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            self._send_to(conn, payload)

    def _send_to(self, conn, payload: bytes) -> None:
        try:
            conn.send_bytes(payload)
        except (OSError, ValueError) as e:
            self._fail(f"a worker's connection is closed ({e})")

    def finish(self, handle: int) -> RunnerOutput:
        """The driver's output of step `handle` (steps finish in launch order)."""
        assert handle == self._finished + 1, (handle, self._finished)
        self._raise_if_dead()
        if self._overlap and handle == self._launched:
            # no step queued behind this one: the workers would wait for it, so ask for the result
            self._send_all(("finish",))
        msg = self._recv(self.driver)
        if msg[0] == "error":
            self._fail(f"worker rank {self.driver} raised:\n{msg[1]}")
        self._finished = handle
        if msg[1].expert_token_counts is not None:
            self._expert_counts = msg[1].expert_token_counts
        return msg[1]

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.finish(self.launch(sched))

    def _recv(self, rank: int):
        """The next message of `rank`, watching every other rank meanwhile: any message from
        another rank (only errors are sent unasked) fails the executor."""
        while True:
            for r, msg in self._poll():
                if r == rank:
                    return msg
                if msg[0] == "error":
                    self._fail(f"worker rank {r} raised:\n{msg[1]}")
                self._fail(f"unexpected message from worker rank {r}: {msg[0]!r}")

    def _poll(self, deadline: float | None = None) -> list[tuple[int, tuple]]:
        """(rank, message) of every rank with one waiting (up to POLL_S s); a closed connection,
        an exited process or the deadline fails the executor."""
        got = []
        for ready in wait(self._conns, timeout=POLL_S):
            r = self._conns.index(ready)
            try:
                got.append((r, pickle.loads(ready.recv_bytes())))
            except (EOFError, OSError):
                self._fail(f"worker rank {r} (pid {self._procs[r].pid}) died (exit code {_exit_code(self._procs[r])})")
        if not got:
            self._check_procs("running")
            if deadline is not None and time.monotonic() > deadline:
                self._fail("the workers did not answer in time")
        return got

    # ---- failure and shutdown ------------------------------------------------------------------
    def _check_procs(self, phase: str) -> None:
        for r, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None:
                self._fail(f"worker rank {r} (pid {proc.pid}) exited while {phase} (exit code {code})")

    def check_health(self) -> None:
        self._raise_if_dead()
        self._check_procs("idle")

    def _stop_ranks(self) -> None:
        _stop_processes(self._procs, self._conns, graceful=False)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def shutdown(self) -> None:
        self._finalizer()


def _exit_code(proc: subprocess.Popen) -> int | None:
    try:
        return proc.wait(5)
    except subprocess.TimeoutExpired:
        return None


def _stop_processes(procs: list[subprocess.Popen], conns: list, graceful: bool = True) -> None:
    """Ask every worker to stop, wait a little, then kill what is left; close the connections."""
    if graceful:
        for conn in conns:
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + (STOP_TIMEOUT_S if graceful else 0.0)
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()
    conns.clear()
