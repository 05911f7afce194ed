"""`--timeline FILE.html|FILE.png` and `--profile` for the benchmark commands.

    with observe_run(args, engine, "W1 on qwen3-0.6b"):
        ...the timed run...

--timeline keeps every step record of the run (the engine's StepHistory, made large enough)
and writes the plot afterwards (bench/timeline.py). --profile runs the torch profiler over the
run and writes a Chrome trace (open in chrome://tracing or https://ui.perfetto.dev) to
--profile-dir (default ./profiles): the engine's host work (schedule, launch, update) and,
on a GPU, the kernels, so host gaps between kernels show; with worker processes
(--distributed-executor-backend mp/ray) one more trace per rank (bench-rank<r>-...).
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
            _stop_profile(engine, args.profile_dir)
        if timeline is not None:
            from minivllm.bench.timeline import write_timeline
            log(f"timeline: {write_timeline(history.since(first).records, timeline, title)}")


def _stop_profile(engine, directory: str) -> None:
    """The engine's trace, then every worker rank's (mp/ray executors: written by the ranks)."""
    from minivllm.engine.profiler import wait_for_traces
    log(f"profile: {engine.profiler.stop(directory, 'bench')}")
    paths = engine.profiler.rank_trace_paths
    missing = wait_for_traces(paths)
    for p in paths:
        log(f"profile: {p}" + (" (not written in time)" if p in missing else ""))


class ServerObserver:
    """--timeline and --profile for a benchmark against a running minivllm server: the step
    records come from its dashboard's event stream (/dashboard/events), the trace from its
    /start_profile and /stop_profile (the server needs --profile-dir; the trace is written there)."""

    def __init__(self, args, client, headers: dict[str, str]) -> None:
        self.args, self.client, self.headers = args, client, headers
        self.base = args.base_url.rstrip("/")
        self.records: list[dict] = []
        self._task = None

    async def start(self) -> None:
        import asyncio
        import time
        if getattr(self.args, "profile", False):
            r = await self.client.post(self.base + "/start_profile", headers=self.headers)
            if r.status_code != 200:
                raise ValueError(f"--profile: POST /start_profile answered {r.status_code} (start the server with "
                                 "--profile-dir DIR)")
        if getattr(self.args, "timeline", None):
            self._task = asyncio.create_task(self._collect(time.time()))

    async def _collect(self, t0: float) -> None:
        import json
        key = self.args.api_key
        url = self.base + "/dashboard/events" + (f"?api_key={key}" if key else "")
        async with self.client.stream("GET", url, timeout=None) as r:
            if r.status_code != 200:
                log(f"--timeline: {url} answered {r.status_code} (a minivllm server with its dashboard on?)")
                return
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    self.records += [s for s in json.loads(line[6:])["steps"] if s["t"] >= t0]

    async def finish(self, title: str) -> None:
        import asyncio
        if self._task is not None:
            await asyncio.sleep(2 * 0.5)  # the dashboard's last updates (it sends every 0.5 s)
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception) as e:  # noqa: BLE001 - the stream ends either way
                if not isinstance(e, asyncio.CancelledError):
                    log(f"--timeline: the event stream failed: {e!r}")
            if self.records:
                from minivllm.bench.timeline import write_timeline
                log(f"timeline: {write_timeline(self.records, self.args.timeline, title)}")
        if getattr(self.args, "profile", False):
            await self.client.post(self.base + "/stop_profile", headers=self.headers)
            log("profile: the server writes its trace to its --profile-dir")
