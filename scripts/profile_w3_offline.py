"""Development probe: W3's 1,000 requests all at once through the engine core alone (no HTTP), with
the server's engine settings (1,024 sequences, 8,192-token steps, async scheduling, DELTA
outputs), timing every step's host phases, so that the serving gap can be split into "engine
core" and "everything around it".

    python3 scripts/profile_w3_offline.py [--num-requests 1000] [--config qwen3-8b] [--profile-at 400]

Per step it records: wall time since the previous step, the host time of each phase (schedule,
launch = input building + kernel launches, wait = blocking on the device, update, outputs),
the number of scheduled tokens and running requests. Steps are grouped into pure-decode steps
and steps that carry prefill tokens.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from minivllm.bench.model_dirs import write_model_dir
from minivllm.bench.step_stats import is_decode_step, summarize
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.server.bench_serve import make_workload

class LaunchTracer:
    """Times the parts of ModelRunner.launch (by wrapping them) and counts the device and
    pinned-host allocator's calls to the driver per step: which part of a launch blocks."""

    PARTS = ("build_step_inputs", "_fill_placeholders", "_forward_logits", "_launch_sampling")

    def __init__(self, runner) -> None:
        from minivllm.runner import model_runner
        self.times: dict[str, float] = {}
        for name in self.PARTS:
            owner = model_runner if name == "build_step_inputs" else runner
            setattr(owner, name, self._timed(name, getattr(owner, name)))
        # inside _forward_logits: the graph (or None), the eager forward, the LM head
        if runner.graphs is not None:
            runner.graphs.try_run = self._timed("graph_try_run", runner.graphs.try_run)
        runner.model.compute_logits = self._timed("compute_logits", runner.model.compute_logits)

    def _timed(self, name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    @staticmethod
    def _counters() -> dict[str, int]:
        dev = torch.cuda.memory_stats()
        host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        return {"dev_alloc": dev.get("num_device_alloc", 0), "dev_free": dev.get("num_device_free", 0),
                "host_alloc": host.get("num_host_alloc", 0), "host_free": host.get("num_host_free", 0)}

    def begin(self) -> None:
        self.times = {}
        self.before = self._counters()

    def end(self) -> dict:
        after = self._counters()
        return {**{"t_" + k.strip("_"): v for k, v in self.times.items()},
                **{k: after[k] - self.before[k] for k in after}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--config", default="qwen3-8b")
    ap.add_argument("--profile-at", type=int, nargs="*", default=[],
                    help="torch.profiler over 4 steps from each of these steps")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the server's 8,192")
    ap.add_argument("--profile-sort", default="cuda_time_total",
                    help="column the profile table is sorted by (self_cpu_time_total finds host blocking)")
    ap.add_argument("--max-graph-tokens", type=int, default=None,
                    help="largest mixed-step CUDA graph (default: runner/cuda_graph.MAX_MIXED_TOKENS)")
    ap.add_argument("--trace-launch", action="store_true",
                    help="per step: host time of each part of the launch, and device/pinned-host allocator calls")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.max_graph_tokens is not None:
        from minivllm.runner import cuda_graph
        cuda_graph.MAX_MIXED_TOKENS = args.max_graph_tokens
    d = write_model_dir(args.config)
    t_load = time.perf_counter()
    eng = LLMEngine.from_kwargs(model=d, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
                                serving=True, max_num_batched_tokens=args.max_num_batched_tokens)
    t_load = time.perf_counter() - t_load
    work = make_workload(args.num_requests, 0, (100, 1024), (100, 1024), eng.config.model.arch.vocab_size)
    # warm-up: a prefill and a few decode steps (first Triton compiles)
    eng.add_request("warm", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()

    sched = eng.scheduler
    for i, r in enumerate(work):
        eng.add_request(f"r{i}", r.prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.max_tokens,
                                                                   output_kind=RequestOutputKind.DELTA))
    tracer = LaunchTracer(eng.executor.runner) if args.trace_launch else None
    records = []
    out_tokens = 0
    t0 = last = time.perf_counter()
    step = 0
    while eng.has_unfinished_requests():
        prof = None
        if step in args.profile_at:
            torch.cuda.synchronize()
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            tp = time.perf_counter()
        if tracer is not None:
            tracer.begin()
        outs = eng.step()
        if tracer is not None:
            eng.last_step.update(tracer.end())
        if prof is not None:
            for _ in range(3):
                outs += eng.step()
            torch.cuda.synchronize()
            tp = time.perf_counter() - tp
            prof.__exit__(None, None, None)
            kind = "decode" if is_decode_step(eng.last_step) else "mixed"
            print(f"profiled 4 steps from step {step} ({kind}, {sched.num_running} running, "
                  f"{eng.last_step['tokens']} tokens in the last): {tp * 1000 / 4:.2f} ms/step wall", flush=True)
            print(prof.key_averages().table(sort_by=args.profile_sort, row_limit=16, max_name_column_width=50))
        for o in outs:
            out_tokens += sum(len(c.token_ids) for c in o.outputs)
        if prof is not None:
            step += 4
            last = time.perf_counter()
            continue
        now = time.perf_counter()
        records.append({"wall": now - last, **eng.last_step})
        last = now
        step += 1
        if args.max_steps is not None and step >= args.max_steps:
            break
    wall = time.perf_counter() - t0
    summary = {"config": args.config, "num_requests": args.num_requests, "load_s": round(t_load, 1),
               "wall_s": round(wall, 2), "output_tokens": out_tokens, "output_tok_s": round(out_tokens / wall, 1),
               "steps": step, "preemptions": sched.num_preemptions,
               "max_num_seqs": eng.config.scheduler.max_num_seqs,
               "max_num_batched_tokens": eng.config.scheduler.max_num_batched_tokens,
               "kv_blocks": eng.block_manager.num_blocks,
               "max_graph_tokens": args.max_graph_tokens, "startup_timings": eng.executor.runner.timings,
               "memory_report": getattr(eng.executor.runner, "memory_report", None),
               "alloc": {k: v for k, v in torch.cuda.memory_stats().items()
                         if k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")}}
    summary.update(summarize(records))
    print(json.dumps(summary, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"summary": summary, "records": records}, f)


if __name__ == "__main__":
    main()
