"""The host's work in one decode step at batch 256, phase by phase, without a GPU.

W1 on several GPUs is bound by the host (docs/perf.md, "The multi-GPU run on 4 H200s"): the engine
core's update, output processing, scheduling and step message, then the rank's unpickling, request
state and input building, all in series with the device's step. This times those phases on the CPU
with the tiny model (its forward is not timed), per step at a full batch:

    python scripts/host_step_bench.py [--requests 256] [--steps 64] [--json OUT]

Figures are medians over the steps where every request decodes; the CPU's absolute speed differs
from a GPU host's, so compare runs of this script on one machine (before / after a change).
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import statistics
import sys
import time
from collections import defaultdict

TINY = os.path.join(os.path.dirname(__file__), "..", "minivllm", "bench", "configs", "tiny-llama")


def _timed(owner, name: str, label: str, times: dict, only=None):
    """Wrap owner.name so that each call's wall time is appended to times[label]."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = original(*args, **kwargs)
        if only is None or only(args, out):
            times[label].append(time.perf_counter() - t)
        return out

    setattr(owner, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=64, help="output tokens a request")
    p.add_argument("--prompt-len", type=int, default=128, help="(W1's prompts: 100-1024 tokens)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from minivllm import LLM, SamplingParams
    from minivllm.core.scheduler import Scheduler
    from minivllm.engine.output_processor import OutputProcessor
    from minivllm.bench.common import emit
    from minivllm.runner.model_runner import ModelRunner

    llm = LLM(model=TINY, load_format="dummy", device="cpu", dtype="float32", max_num_seqs=args.requests,
              max_num_batched_tokens=65536, skip_tokenizer_init=True, kv_cache_memory_bytes=2_000_000_000,
              async_scheduling=True, seed=0)
    random.seed(0)
    prompts = [{"prompt_token_ids": [random.randint(0, 900) for _ in range(args.prompt_len)]} for _ in range(args.requests)]
    params = SamplingParams(temperature=0.6, max_tokens=args.steps, ignore_eos=True)
    llm.generate(prompts[:8], params, use_tqdm=False)

    times: dict[str, list[float]] = defaultdict(list)
    full = args.requests

    def full_decode(sched) -> bool:  # the step schedules every request, one token each
        return len(sched.scheduled) == full and sched.num_scheduled_tokens == full

    def returns_one(a, out):  # (schedule)
        return full_decode(out)

    def takes_one(a, out):  # (update, _update_states, _step_inputs: the SchedulerOutput is their first argument)
        return full_decode(a[1])

    _timed(Scheduler, "schedule", "core: schedule", times, returns_one)
    _timed(Scheduler, "update", "core: update", times, takes_one)
    _timed(OutputProcessor, "process", "core: outputs", times,
           lambda a, out: len(a[1]) == full)
    _timed(ModelRunner, "_update_states", "rank: request state", times, takes_one)
    _timed(ModelRunner, "_step_inputs", "rank: input arrays", times, takes_one)
    # the step message: what the mp executor pickles once and each rank unpickles
    original_schedule = Scheduler.schedule

    def schedule_and_message(self, *a, **kw):
        out = original_schedule(self, *a, **kw)
        if full_decode(out):
            t = time.perf_counter()
            payload = pickle.dumps(("step", out, None), protocol=pickle.HIGHEST_PROTOCOL)
            t1 = time.perf_counter()
            pickle.loads(payload)
            t2 = time.perf_counter()
            times["core: pickle the step"].append(t1 - t)
            times["rank: unpickle the step"].append(t2 - t1)
            times["message bytes"].append(len(payload))
        return out

    Scheduler.schedule = schedule_and_message
    llm.generate(prompts, params, use_tqdm=False)

    result = {}
    for label, values in times.items():
        if label == "message bytes":
            result[label] = int(statistics.median(values))
        else:
            result[label + " (ms)"] = round(statistics.median(values) * 1e3, 3)
        result.setdefault("steps measured", len(values))
    host_ms = sum(v for k, v in result.items() if k.endswith("(ms)"))
    result["sum of the phases (ms)"] = round(host_ms, 3)
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
