"""`--timeline FILE.html|FILE.png` and `--profile` for the benchmark commands.

    with observe_run(args, engine, "W1 on qwen3-0.6b"):
        ...the timed run...

--timeline keeps every step record of the run (the engine's StepHistory, made large enough)
and writes the plot afterwards (bench/timeline.py). --profile runs the torch profiler over the
run and writes a Chrome trace (open in chrome://tracing or https://ui.perfetto.dev) to
--profile-dir (default ./profiles): the engine's host work (schedule, launch, update) and,
on a GPU, the kernels, so host gaps between kernels show.
"""

from __future__ import annotations

import contextlib

from minivllm.bench.common import log

TIMELINE_CAPACITY = 1 << 20  # steps a run may keep (a StepRecord is ~0.3 KB: ~300 MB at most)


def add_observe_args(p) -> None:
    p.add_argument("--timeline", default=None, metavar="FILE.html|FILE.png",
                   help="write the run's scheduling timeline (batch size, token budget use, prefill/decode, "
                        "KV use, preemptions, queue) to this file")
    p.add_argument("--profile", action="store_true",
                   help="torch-profiler Chrome trace of the run (engine host work and GPU kernels) in --profile-dir")
    p.add_argument("--profile-dir", default="profiles", help="where --profile writes its trace")


@contextlib.contextmanager
def observe_run(args, engine, title: str, with_cuda: bool = False):
    """engine: minivllm's LLMEngine (None for a peer's: --timeline and --profile are then refused)."""
    history = getattr(engine, "history", None)
    timeline = getattr(args, "timeline", None)
    if timeline is not None:
        if history is None:
            raise ValueError("--timeline needs minivllm's engine (its step records)")
        history.set_capacity(TIMELINE_CAPACITY)
        history.clear()
        first = history.next_step
    profile = getattr(args, "profile", False)
    if profile:
        if engine is None:
            raise ValueError("--profile needs minivllm's engine")
        engine.profiler.start(with_cuda)
    try:
        yield
    finally:
        if profile:
            log(f"profile: {engine.profiler.stop(args.profile_dir, 'bench')}")
        if timeline is not None:
            from minivllm.bench.timeline import write_timeline
            log(f"timeline: {write_timeline(history.since(first).records, timeline, title)}")
