"""Where a speculative step's time goes (issue 19: W8's n-gram row at batch 1 ran 5.4 ms a step
against 1.33 ms a plain token on an H100; at batch 32, with no draft scheduled, n-gram ran 0.89x
of no speculation in lease 8). The first --batch W8 prompts (default 1) in one call, greedy, on
the default model's real weights (a Hugging Face directory), for each method:

- the engine's step phases (schedule, launch, wait, update, outputs) summed over the steps, with
  the steps' wall time, so host time per step can be read against the step period;
- under the torch profiler: the GPU kernel time per step and the host calls that cost most
  (kernel launches, graph launches, copies, synchronisations).

    python3 scripts/spec_profile.py --model /tmp/smollm2-bf16 --methods none,ngram --out spec-profile.json
    python3 scripts/spec_profile.py --model /tmp/smollm2-bf16 --batch 32 --out spec-profile-32.json

MINIVLLM_SPEC_HOST_VERIFY=0 turns the host-side greedy verification off (the device path then
verifies), so both can be compared in one lease.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _phases(llm, run):
    """Runs `run()` with every engine step's phase times summed: (dict of ms, steps, wall s)."""
    engine = llm.llm_engine
    totals: dict[str, float] = {}
    steps = 0
    original = engine.step

    def step():
        nonlocal steps
        out = original()
        steps += 1
        for k, v in engine.last_step.items():
            if k not in ("tokens", "seqs", "running"):
                totals[k] = totals.get(k, 0.0) + v
        return out

    engine.step = step
    t = time.perf_counter()
    try:
        run()
    finally:
        engine.step = original
    return {k: round(v * 1000, 2) for k, v in totals.items()}, steps, time.perf_counter() - t


def _host_calls(prof, top: int) -> list[dict]:
    rows = []
    for ev in prof.key_averages():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        name = ev.key
        if name.startswith("cuda") or name.startswith("aten::") or name.startswith("minivllm."):
            rows.append({"name": name[:100], "calls": ev.count, "self_ms": round(ev.self_cpu_time_total / 1000, 3),
                         "total_ms": round(ev.cpu_time_total / 1000, 3)})
    rows.sort(key=lambda r: -r["self_ms"])
    return rows[:top]


def profile_method(args, name: str, spec: dict | None, prompts: list[list[int]]) -> dict:
    from minivllm import LLM, SamplingParams
    from minivllm.engine.profiler import kernel_times
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0, speculative_config=spec,
              gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def run():
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    run()  # warm-up
    phases, steps, wall = _phases(llm, run)
    s = llm.llm_engine.get_stats()
    cuda = torch.cuda.is_available()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    kernels = kernel_times(prof)
    kernel_ms = sum(k["ms"] for k in kernels)
    result = {"method": name, "steps": steps, "wall_ms": round(wall * 1000, 1),
              "ms_per_step": round(wall * 1000 / max(steps, 1), 3),
              "tok_per_s": round(len(prompts) * args.max_tokens / wall, 1), "batch": len(prompts),
              "phase_ms_per_step": {k: round(v / max(steps, 1), 3) for k, v in phases.items()},
              "gpu_kernel_ms_per_step": round(kernel_ms / max(steps, 1), 3),
              "spec_accepted": getattr(s, "spec_num_accepted_tokens", None),
              "spec_drafts": getattr(s, "spec_num_drafts", None),
              "top_kernels": kernels[:args.top], "top_host_calls": _host_calls(prof, args.top)}
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("top_")}), flush=True)
    for r in result["top_host_calls"][:15]:
        print(f"  host {r['self_ms']:9.2f} ms self {r['calls']:7d} calls  {r['name']}")
    for r in kernels[:10]:
        print(f"  gpu  {r['ms']:9.2f} ms      {r['calls']:7d} calls  {r['kernel'][:90]}")
    del llm
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--methods", default="none,ngram")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1, help="the first this many W8 prompts, in one call")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from minivllm.bench.common import in_fresh_process
    from minivllm.bench.spec_bench import prompt_ids
    prompts = prompt_ids(args.model, args.batch)
    configs = {"none": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}}
    results = [in_fresh_process(profile_method, args, m, configs[m], prompts) for m in args.methods.split(",")]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "host_verify": os.environ.get("MINIVLLM_SPEC_HOST_VERIFY", "1"),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
