"""One rank: its device, its shard of the model and of the KV cache, and its runner.

`Worker` is the same for both distributed executors (mp: in a process started by
`python -m minivllm.executor.worker`, see `main`; ray: inside a Ray actor). Its life:

    Worker(config, rank, init_method, device_index)   join the process groups
    load() -> planned KV blocks                        load this rank's shard, size its budget
    init_kv(num_blocks)                                the executor's minimum over every rank
    launch(sched) / finish(launched)                   every step, on every rank, in order
    shutdown()

The mp process loop (`serve`): one pickled ("step", SchedulerOutput, GrammarBitmask | None)
message per step arrives on the connection, and ("profile", "start" | "stop", path) between steps (the bitmask only for a step with constrained rows) (the executor pickles it once and writes the same bytes to every rank); the
driver rank (last stage, TP rank 0) answers each with ("out", RunnerOutput); the other ranks
answer nothing. ("expert_counts",) between steps: the driver answers ("counts", per-layer
counts of a MoE model, or None). ("finish",): with async scheduling, take in the step in flight
now (none will be queued behind it; see serve). With async scheduling and
MINIVLLM_DRIVER_REPLY_THREAD=1 the driver's answers go out from a reply thread (`Replier`): each
step's output as soon as the device has run it; by default the main thread answers. Any
exception is sent as ("error", traceback) and the process exits; a closed connection (the engine
is gone) makes it exit too, so no worker outlives its engine.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import queue
import sys
import threading
import traceback

import torch

from minivllm.config import EngineConfig
from minivllm.core.interfaces import RunnerOutput, SchedulerOutput
from minivllm.distributed.sharding import RankInfo
from minivllm.engine.gc_heap import freeze_startup_heap
from minivllm.structured.bitmask import GrammarBitmask

logger = logging.getLogger(__name__)

AUTHKEY_ENV = "MINIVLLM_WORKER_AUTHKEY"  # the executor's connection key (hex), never on a command line


def rank_device(config: EngineConfig, rank: int, device_index: int | None = None) -> torch.device:
    """CPU, or the rank's GPU: by default GPU dp_rank * world_size + rank of this machine (Ray
    gives each actor its own GPU, index 0 of what it sees)."""
    if not config.device.startswith("cuda"):
        return torch.device("cpu")
    if device_index is None:
        device_index = config.parallel.data_parallel_rank * config.parallel.world_size + rank
    return torch.device("cuda", device_index)


class Worker:
    def __init__(self, config: EngineConfig, rank: int, init_method: str, device_index: int | None = None,
                 cpu_threads: int | None = None) -> None:
        from minivllm.distributed.parallel_state import ParallelGroups, init_distributed
        from minivllm.runner.model_runner import ModelRunner
        p = config.parallel
        self.rank = RankInfo.of(rank, p.tensor_parallel_size, p.pipeline_parallel_size)
        device = rank_device(config, rank, device_index)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif cpu_threads is not None:
            torch.set_num_threads(cpu_threads)  # the ranks share the machine's cores
        replicas = p.data_parallel_size if p.spans_replicas else 1
        self.parallel = (init_distributed(self.rank, init_method, device, p.data_parallel_rank if replicas > 1 else 0,
                                          replicas, p.enable_expert_parallel, p.disable_custom_all_reduce)
                         if self.rank.world_size * replicas > 1 else ParallelGroups.single(device))
        self.runner = ModelRunner(config, self.parallel, device)
        self._profiler = None  # this rank's torch-profiler trace while one runs (profile())

    @property
    def is_driver(self) -> bool:
        return self.rank.is_driver

    def load(self) -> int:
        """Load this rank's shard; returns the KV blocks this rank's budget holds."""
        self.runner.load_model()
        return self.runner.plan_kv_blocks()

    def init_kv(self, num_blocks: int) -> int:
        """Allocate the KV cache, capture and warm up; returns the startup objects frozen."""
        self.runner.allocate_kv_blocks(num_blocks)
        self.runner.capture_cuda_graphs()
        self.runner.warm_up_kernels()
        self.runner.expert_counts.reset()  # count requests' tokens only, not the startup passes
        # A rank lives as long as its engine, as the engine core does: its startup heap (torch,
        # the model's modules, ~180,000 objects) is frozen as the core's is, so that a full GC
        # pass does not walk it in the middle of a step (~70 ms on the development CPU). Lease
        # 84's tp=2 trace: one rank's device idled ~24 ms three times in 47 steps while the
        # other waited in an all-reduce (engine/gc_heap.py).
        freeze_startup_heap()
        return gc.get_freeze_count()

    def launch(self, sched: SchedulerOutput, grammar: GrammarBitmask | None = None):
        return self.runner.launch_sampling(self.runner.launch_forward(sched), grammar)

    def finish(self, launched) -> RunnerOutput | None:
        """Every rank takes in its step (sampling state); only the driver's output goes back."""
        if not self.is_driver:
            self.runner.take_in(launched)
            return None
        return self.runner.finish(launched)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput | None:
        return self.finish(self.launch(sched))

    def profile(self, action: str, path: str | None = None) -> None:
        """This rank's own torch-profiler trace (engine/profiler.py): "start", or "stop" and
        write it to path. A start while one runs or a stop without one is logged, not raised."""
        from minivllm.engine.profiler import EngineProfiler, export_trace
        try:
            if action == "start":
                if self._profiler is not None:
                    raise ValueError("a profile is already running on this rank")
                self._profiler = EngineProfiler()
                self._profiler.start()
                return
            if self._profiler is None:
                raise ValueError("no profile is running on this rank")
            prof, self._profiler = self._profiler, None
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            export_trace(prof.take(), path)
            logger.info("rank %d: torch profiler trace written to %s", self.rank.rank, path)
        except ValueError as e:
            logger.warning("rank %d: %s", self.rank.rank, e)

    def shutdown(self) -> None:
        from minivllm.distributed.parallel_state import destroy_distributed
        if self.parallel.pipeline is not None:
            self.parallel.pipeline.flush()
        destroy_distributed()


def serve(conn, worker: Worker, overlap: bool) -> None:
    """The step loop of an mp worker (see the module docstring). overlap (async scheduling):
    the step in flight is taken in only once the next step has arrived and been launched behind
    it, as the in-process engine does, so the device never waits for the connection; when the
    engine core needs the result with no step to queue behind it, it sends ("finish",). (Polling
    for the next step instead lost the overlap at every step: the engine core sends step N + 1 a
    few milliseconds after it has taken in N - 1, while N still runs.) With the Replier on
    (`reply_thread_enabled`), the driver's output of a step does not wait for that: the Replier
    sends it once the device is done with the step."""
    replier = Replier(conn, worker.runner) if overlap and worker.is_driver and reply_thread_enabled() else None
    pending = None

    def take_in(step) -> None:
        if replier is None:
            _reply(conn, worker.finish(step))
            return
        worker.runner.take_in(step)
        replier.attach_counts(worker.runner.new_expert_counts())

    while True:
        if pending is not None and not overlap:
            take_in(pending)
            pending = None
        msg = pickle.loads(conn.recv_bytes())
        if msg[0] == "stop":
            break
        if msg[0] == "finish":
            if pending is not None:
                take_in(pending)
                pending = None
            continue
        if msg[0] == "profile":  # between two steps: the trace holds whole steps
            worker.profile(msg[1], msg[2])
            continue
        if msg[0] == "expert_counts":  # sent with no step in flight; only the driver answers
            if worker.is_driver:
                counts = ("counts", worker.runner.expert_counts.per_layer())
                if replier is not None:  # after the outputs it still holds
                    replier.send(counts)
                else:
                    _send(conn, counts)
            continue
        launched = worker.launch(msg[1], msg[2])
        if replier is not None:
            replier.put(launched)
        if pending is not None:
            take_in(pending)
        pending = launched
    if pending is not None:
        take_in(pending)
    if replier is not None:  # (after an error, main() reports it and exits without waiting for the thread)
        replier.close()


def reply_thread_enabled() -> bool:
    """The driver's Replier is off unless MINIVLLM_DRIVER_REPLY_THREAD=1. Off, the main thread
    answers after the next launch. Lease 65 (W1-8B, tp=1, mp executor, one H200) measured the
    thread at -7 % output tok/s: it takes the GIL from the main thread's next step. Its intended
    case, tp=2, is not measured yet (docs/perf.md)."""
    return os.environ.get("MINIVLLM_DRIVER_REPLY_THREAD", "0") == "1"


# the GIL switch interval of a driver with a Replier: the reply thread wakes when the device ends
# a step and must not wait the default 5 ms for the main thread, which builds the next step's
# inputs in Python meanwhile (the in-process engine does the same beside a grammar fill)
REPLY_SWITCH_INTERVAL_S = 0.0002


class Replier:
    """The mp driver's answers, sent in order from a thread of their own (async scheduling only).
    Why: the main thread finishes a step only after it has received, built and launched the next
    one (serve), ~3-4 ms at batch 256 on a GPU host; had the output waited for that too, the
    engine core's own work for the step after (~5 ms) would start that much later, in series
    with the device instead of beside it (docs/perf.md, lease 58's traces at tp=2). So each
    launched step is `put` here at once; this thread waits for its device work
    (ModelRunner.step_output, which changes no request state) and sends it; the main thread takes
    the tokens into the request state at its usual point (ModelRunner.take_in). MoE counts read
    by the main thread travel with the next output sent. Any error here is sent to the executor
    and ends the process, as an error of the main thread does."""

    def __init__(self, conn, runner) -> None:
        self._conn, self._runner = conn, runner
        self._items: queue.SimpleQueue = queue.SimpleQueue()  # launched steps, or ("msg", tuple) to send as is
        self._counts = None  # MoE counts for the next output (guarded by _lock)
        self._lock = threading.Lock()
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(REPLY_SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name="minivllm-driver-replies", daemon=True)
        self._thread.start()

    def put(self, launched) -> None:
        """Send this launched step's output once the device has run it (after those put before)."""
        self._items.put(launched)

    def send(self, msg: tuple) -> None:
        """Send msg after the outputs put before it."""
        self._items.put(("msg", msg))

    def attach_counts(self, counts) -> None:
        if counts is not None:
            with self._lock:
                self._counts = counts

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        self._items.put(None)
        self._thread.join()
        sys.setswitchinterval(self._switch_interval)

    def _run(self) -> None:
        if self._runner.device.type == "cuda":
            torch.cuda.set_device(self._runner.device)  # (the CUDA device is per thread)
        try:
            while (item := self._items.get()) is not None:
                if isinstance(item, tuple):
                    _send(self._conn, item[1])
                    continue
                out = self._runner.step_output(item)
                with self._lock:
                    counts, self._counts = self._counts, None
                if counts is not None:
                    out.expert_token_counts = counts
                _reply(self._conn, out)
        except (EOFError, ConnectionError, OSError):
            os._exit(0)  # the engine is gone: nobody to answer
        except BaseException:  # noqa: BLE001 - the executor must hear what failed
            logger.exception("the driver's reply thread failed")
            try:
                _send(self._conn, ("error", traceback.format_exc()))
            except (OSError, EOFError):
                pass
            os._exit(1)


_SEND_LOCK = threading.Lock()  # one message at a time on a connection (the Replier sends beside the main thread)


def _send(conn, msg: tuple) -> None:
    payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    with _SEND_LOCK:
        conn.send_bytes(payload)


def _reply(conn, out: RunnerOutput | None) -> None:
    if out is not None:
        _send(conn, ("out", out))


def main(argv: list[str]) -> int:
    """python -m minivllm.executor.worker HOST PORT RANK: connect to the executor, then run."""
    from multiprocessing.connection import Client
    import faulthandler
    import signal
    host, port, rank = argv[0], int(argv[1]), int(argv[2])
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a stuck rank is
    _exit_with_parent()
    conn = Client((host, port), authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    conn.send(("hello", rank, os.getpid()))
    try:
        _, config, init_method, cpu_threads, log_level = conn.recv()
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
        worker = Worker(config, rank, init_method, cpu_threads=cpu_threads)
        conn.send(("planned", worker.load()))
        frozen = worker.init_kv(conn.recv()[1])
        conn.send(("ready", frozen))
        _serve_maybe_profiled(conn, worker, config.async_scheduling, rank)
    except (EOFError, ConnectionError):
        os._exit(0)  # the engine is gone: nobody to answer (and no peer to wait for)
    except BaseException:  # noqa: BLE001 - the executor must hear what killed this rank
        logger.exception("worker rank %d failed", rank)
        try:
            _send(conn, ("error", traceback.format_exc()))
        except (OSError, EOFError):
            pass
        os._exit(1)  # no clean-up that could wait on a peer stuck in a collective
    worker.shutdown()  # a clean stop: every step is done, every send was received
    return 0


def _serve_maybe_profiled(conn, worker: Worker, overlap: bool, rank: int) -> None:
    """serve(), under cProfile when MINIVLLM_WORKER_CPROFILE names a directory: the rank's host
    time by function (DIR/worker-rank<r>.prof, written at a clean stop; `python -m pstats`)."""
    directory = os.environ.get("MINIVLLM_WORKER_CPROFILE")
    if not directory:
        serve(conn, worker, overlap)
        return
    import cProfile
    prof = cProfile.Profile()
    try:
        prof.runcall(serve, conn, worker, overlap)
    finally:
        os.makedirs(directory, exist_ok=True)
        prof.dump_stats(os.path.join(directory, f"worker-rank{rank}.prof"))


def _exit_with_parent(interval_s: float = 1.0) -> None:
    """A watchdog thread: when the engine's process is gone (this process is reparented), exit at
    once, wherever the main thread is blocked (a collective waiting on a peer, loading)."""
    import threading
    import time
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="minivllm-parent-watchdog", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
