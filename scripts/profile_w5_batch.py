"""W5's 32-request greedy batch on the CPU through `LLMEngine.step()`: total tok/s, the two prefill
steps' seconds and the median decode step; with `--profile N`, a torch.profiler table of N
decode steps (from step 20), sorted by self CPU time.

    python scripts/profile_w5_batch.py [--profile 5]
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
    args = ap.parse_args()
    llm = LLM(dtype="float32", device="cpu", seed=0)
    wl = workloads.w5(lambda conv: apply_chat_template(llm.get_tokenizer(), conv))
    llm.generate([wl.prompt_inputs()[0]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    eng = llm.llm_engine
    for i, (prompt, params) in enumerate(zip(wl.prompt_inputs(), wl.params)):
        eng.add_request(str(i), prompt, SamplingParams(**params))
    steps, n, t0 = [], 0, time.perf_counter()
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
        n += 1
    total = time.perf_counter() - t0
    print(f"{n} steps in {total:.2f} s = {sum(p['max_tokens'] for p in wl.params) / total:.1f} tok/s; "
          f"prefill steps {[round(s, 2) for s in steps[:2]]} s; median decode step "
          f"{1e3 * statistics.median(steps[2:]):.1f} ms")


if __name__ == "__main__":
    main()
