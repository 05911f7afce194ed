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

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--config", default="qwen3-8b")
    ap.add_argument("--profile-at", type=int, nargs="*", default=[],
                    help="torch.profiler over 4 steps from each of these steps")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the server's 8,192")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
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
        outs = eng.step()
        if prof is not None:
            for _ in range(3):
                outs += eng.step()
            torch.cuda.synchronize()
            tp = time.perf_counter() - tp
            prof.__exit__(None, None, None)
            kind = "decode" if is_decode_step(eng.last_step) else "mixed"
            print(f"profiled 4 steps from step {step} ({kind}, {sched.num_running} running, "
                  f"{eng.last_step['tokens']} tokens in the last): {tp * 1000 / 4:.2f} ms/step wall", flush=True)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=50))
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
    wall = time.perf_counter() - t0
    summary = {"config": args.config, "num_requests": args.num_requests, "load_s": round(t_load, 1),
               "wall_s": round(wall, 2), "output_tokens": out_tokens, "output_tok_s": round(out_tokens / wall, 1),
               "steps": step, "preemptions": sched.num_preemptions,
               "max_num_seqs": eng.config.scheduler.max_num_seqs,
               "max_num_batched_tokens": eng.config.scheduler.max_num_batched_tokens,
               "kv_blocks": eng.block_manager.num_blocks}
    summary.update(summarize(records))
    print(json.dumps(summary, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"summary": summary, "records": records}, f)


if __name__ == "__main__":
    main()
