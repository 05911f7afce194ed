"""torch-profiler traces of the engine (vLLM's /start_profile and /stop_profile, and the
benchmarks' --profile): Chrome trace files (chrome://tracing, https://ui.perfetto.dev).

While a trace runs, the engine's step phases are labelled (`minivllm.schedule`,
`minivllm.launch`, `minivllm.wait`, `minivllm.update`) so host time between GPU kernels can be
read off the trace; when none runs, `phase` is a no-op (no torch call per step).

With worker processes (the mp and ray executors, executor/worker.py), the model runs outside
the engine's process: every rank then traces itself too, started and stopped through its
executor in the same order as the steps, and writes its own file next to the engine's:

    DIR/engine-<time>-<pid>.pt.trace.json             the engine (core) process
    DIR/engine-[dp<i>-]rank<r>-<time>-<pid>.pt.trace.json   worker rank r (of replica i)

A rank writes its file when its stop message arrives (after the steps sent before it), so the
files appear a moment after `stop` returns; `wait_for_traces` waits for them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

logger = logging.getLogger(__name__)

_NO_PHASE = contextlib.nullcontext()


class EngineProfiler:
    def __init__(self) -> None:
        self._prof = None
        self._record_function = None
        self._ranks: list[tuple[object, str]] = []  # (executor with worker ranks, file name prefix)
        self.rank_trace_paths: list[str] = []  # the files the last stop asked the ranks to write

    def add_ranks(self, executor, prefix: str = "") -> None:
        """Also trace this executor's worker ranks (an executor without `start_rank_profiles`
        runs the model in this process: the engine's own trace holds it)."""
        if hasattr(executor, "start_rank_profiles"):
            self._ranks.append((executor, prefix))

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self, with_cuda: bool | None = None) -> None:
        """Starts a trace (CPU activity, and CUDA when there is a GPU); ValueError if one runs."""
        if self._prof is not None:
            raise ValueError("a profile is already running: stop it first")
        import torch
        if with_cuda is None:
            with_cuda = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if with_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        prof.start()
        self._prof, self._record_function = prof, torch.profiler.record_function
        for executor, _ in self._ranks:
            _on_ranks(executor.start_rank_profiles)

    def stop(self, directory: str, name: str = "engine") -> str:
        """Stops the trace and writes DIRECTORY/NAME-<time>-<pid>.pt.trace.json; returns the path.
        Worker ranks are told to write theirs (their paths: `rank_trace_paths`)."""
        if self._prof is None:
            raise ValueError("no profile is running: start one first")
        os.makedirs(directory, exist_ok=True)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.rank_trace_paths = []
        for executor, prefix in self._ranks:  # first: the ranks export while this process does
            paths = [os.path.join(directory, f"{name}-{prefix}rank{r}-{stamp}.pt.trace.json")
                     for r in range(executor.world_size)]
            if _on_ranks(executor.stop_rank_profiles, paths):
                self.rank_trace_paths += paths
        path = os.path.join(directory, f"{name}-{stamp}.pt.trace.json")
        export_trace(self.take(), path)
        return path

    def take(self):
        """Stops this process's trace and returns the stopped torch profiler (ranks untouched)."""
        if self._prof is None:
            raise ValueError("no profile is running: start one first")
        prof, self._prof, self._record_function = self._prof, None, None
        prof.stop()
        return prof

    def phase(self, name: str):
        """A labelled range in the trace while one runs; otherwise a shared no-op context."""
        if self._record_function is None:
            return _NO_PHASE
        return self._record_function(name)


def export_trace(prof, path: str) -> None:
    """Writes a stopped profiler's Chrome trace to path; the file appears whole (written aside,
    then renamed), so a reader polling the directory never sees half a file."""
    prof.export_chrome_trace(path + ".partial")
    os.replace(path + ".partial", path)


def kernel_times(prof) -> list[dict]:
    """A stopped profiler's GPU kernels summed by name, most time first: [{"kernel", "ms",
    "calls", "share"}], share = of all kernel time (scripts/kernel_profile.py, gpu_w7.py)."""
    import torch
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", 0) or 0
        if us > 0 and ev.device_type == torch.autograd.DeviceType.CUDA:
            rows.append({"kernel": ev.key[:120], "ms": round(us / 1000, 3), "calls": ev.count})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    for r in rows:
        r["share"] = round(r["ms"] / total, 4) if total else 0.0
    return rows


def device_events(trace_path: str) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel, memcpy and memset of an exported Chrome
    trace, in start order."""
    import json
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    rows = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", "?")[:120])
            for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    rows.sort()
    return rows


def critical_path(events: list[tuple[float, float, str]]) -> dict:
    """Where the device's wall time goes when kernels overlap (programmatic dependent launch
    starts a kernel while its predecessor runs, and its own duration then includes waiting):
    each kernel is charged only the time from the later of its start and the end of everything
    before it, to its end ("exclusive" time); time when no kernel runs is "idle". Exclusive
    times plus idle add up to the span from the first start to the last end. events: in start
    order (device_events). Returns {"span_ms", "idle_ms", "kernels": [{"kernel", "ms",
    "calls", "share"}], most exclusive time first, "idle_between": the 12 largest sums of idle
    time by the pair of kernels around it [{"after", "before", "ms", "count"}]}."""
    by_name: dict[str, list] = {}
    gaps: dict[tuple[str, str], list] = {}  # (kernel before, kernel after) -> [idle us, count]
    frontier = events[0][0] if events else 0.0
    idle = 0.0
    last = ""
    for start, end, name in events:
        if start > frontier:
            idle += start - frontier
            gap = gaps.setdefault((last, name), [0.0, 0])
            gap[0] += start - frontier
            gap[1] += 1
        if end > frontier:
            last = name
        row = by_name.setdefault(name, [0.0, 0])
        row[0] += max(0.0, end - max(start, frontier))
        row[1] += 1
        frontier = max(frontier, end)
    span = (frontier - events[0][0]) if events else 0.0
    rows = [{"kernel": k, "ms": round(v[0] / 1000, 3), "calls": v[1],
             "share": round(v[0] / span, 4) if span else 0.0} for k, v in by_name.items()]
    rows.sort(key=lambda r: -r["ms"])
    idle_rows = [{"after": a[:60], "before": b[:60], "ms": round(v[0] / 1000, 3), "count": v[1]}
                 for (a, b), v in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:12]]
    return {"span_ms": round(span / 1000, 3), "idle_ms": round(idle / 1000, 3), "kernels": rows,
            "idle_between": idle_rows}


def _on_ranks(call, *args) -> bool:
    """A profile command to an executor's ranks; a dead executor is logged here (the engine's
    next step reports it), not raised into the command loop."""
    from minivllm.executor.errors import ExecutorDeadError
    try:
        call(*args)
        return True
    except ExecutorDeadError as e:
        logger.warning("worker ranks not profiled: %s", e)
        return False


def wait_for_traces(paths: list[str], timeout_s: float = 300.0) -> list[str]:
    """Waits until every path exists (worker ranks write theirs after their stop message);
    returns the ones still missing at the timeout."""
    deadline = time.monotonic() + timeout_s
    missing = [p for p in paths if not os.path.exists(p)]
    while missing and time.monotonic() < deadline:
        time.sleep(0.1)
        missing = [p for p in missing if not os.path.exists(p)]
    return missing


def apply_profile_command(engine, action: str, directory: str | None) -> None:
    """On the engine's own thread; a start while one runs (or a stop without one) is logged, not raised."""
    try:
        if action == "start":
            engine.profiler.start()
            logger.info("torch profiler started")
        else:
            logger.info("torch profiler trace written to %s", engine.profiler.stop(directory or ".", "engine"))
            for path in engine.profiler.rank_trace_paths:
                logger.info("worker rank trace goes to %s", path)
    except ValueError as e:
        logger.warning("%s", e)
