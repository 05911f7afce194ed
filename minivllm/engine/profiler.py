"""torch-profiler traces of the engine (vLLM's /start_profile and /stop_profile, and the
benchmarks' --profile): Chrome trace files (chrome://tracing, https://ui.perfetto.dev).

While a trace runs, the engine's step phases are labelled (`minivllm.schedule`,
`minivllm.launch`, `minivllm.wait`, `minivllm.update`) so host time between GPU kernels can be
read off the trace; when none runs, `phase` is a no-op (no torch call per step).
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

    def stop(self, directory: str, name: str = "engine") -> str:
        """Stops the trace and writes DIRECTORY/NAME-<time>-<pid>.pt.trace.json; returns the path."""
        if self._prof is None:
            raise ValueError("no profile is running: start one first")
        prof, self._prof, self._record_function = self._prof, None, None
        prof.stop()
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.pt.trace.json")
        prof.export_chrome_trace(path + ".partial")
        os.replace(path + ".partial", path)  # appears whole: a reader polling the directory never sees half a file
        return path

    def phase(self, name: str):
        """A labelled range in the trace while one runs; otherwise a shared no-op context."""
        if self._record_function is None:
            return _NO_PHASE
        return self._record_function(name)


def apply_profile_command(engine, action: str, directory: str | None) -> None:
    """On the engine's own thread; a start while one runs (or a stop without one) is logged, not raised."""
    try:
        if action == "start":
            engine.profiler.start()
            logger.info("torch profiler started")
        else:
            logger.info("torch profiler trace written to %s", engine.profiler.stop(directory or ".", "engine"))
    except ValueError as e:
        logger.warning("%s", e)
