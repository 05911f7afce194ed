"""W5's 32-request greedy batch on the CPU through `LLMEngine.step()`: total tok/s, the two prefill
steps' seconds and the median decode step; with `--profile N`, a torch.profiler table of N
decode steps (from step 20), sorted by self CPU time. `--num-requests 1` profiles single-stream
decode instead (W5's first prompt alone).

    python scripts/profile_w5_batch.py [--profile 5] [--num-requests N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minivllm import LLM, SamplingParams
from minivllm.bench import workloads
from minivllm.engine.tokenizer import apply_chat_template


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=int, default=0, help="decode steps to profile (0: none)")
    ap.add_argument("--num-requests", type=int, default=32, help="W5's first N prompts (1: single stream)")
    args = ap.parse_args()
    llm = LLM(dtype="float32", device="cpu", seed=0)
    wl = workloads.w5(lambda conv: apply_chat_template(llm.get_tokenizer(), conv))
    llm.generate([wl.prompt_inputs()[0]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    eng = llm.llm_engine
    prompts, params_list = wl.prompt_inputs()[:args.num_requests], wl.params[:args.num_requests]
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        eng.add_request(str(i), prompt, SamplingParams(**params))
    steps, phases, n, t0 = [], [], 0, time.perf_counter()
    while eng.has_unfinished_requests():
        if n == 20 and args.profile:
            with torch.profiler.profile() as prof:
                for _ in range(args.profile):
                    eng.step()
            n += args.profile
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            continue
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
        phases.append(dict(eng.last_step))
        n += 1
    total = time.perf_counter() - t0
    prefill_steps = 2 if args.num_requests > 1 else 1
    print(f"{n} steps in {total:.2f} s = {sum(p['max_tokens'] for p in params_list) / total:.1f} tok/s; "
          f"prefill steps {[round(s, 2) for s in steps[:prefill_steps]]} s; median decode step "
          f"{1e3 * statistics.median(steps[prefill_steps:]):.1f} ms")
    decode = phases[prefill_steps + 1:-1]  # steady decode steps (LLMEngine.last_step's phases)
    names = sorted({k for p in decode for k in p if k not in ("tokens", "seqs", "running")})
    print("median decode phases (ms):", {k: round(1e3 * statistics.median(p.get(k, 0.0) for p in decode), 2)
                                         for k in names})


if __name__ == "__main__":
    main()
