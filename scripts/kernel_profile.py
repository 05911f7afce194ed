"""Where a decode step's GPU time goes, kernel by kernel (issues 21 and 22: batch-1 MoE decode,
batch-invariant W1): a dummy-weight model decodes a fixed batch under the torch profiler, eager
(every kernel itemised; CUDA graphs would hide them), and the kernels are summed by name.

    python3 scripts/kernel_profile.py --model-config qwen3-0.6b --batch 256 --batch-invariant --out bi.json
    python3 scripts/kernel_profile.py --model-config qwen3-30b-a3b --batch 1 --out moe1.json
    python3 scripts/kernel_profile.py --model-config llama-3.1-8b --awq --batch 1 --out awq1.json
    python3 scripts/kernel_profile.py --model-config qwen3-8b --fp8 --graphs --batch 256 --out fp8.json

--awq: the model directory carries AutoAWQ's quantization_config (W11-awq, random packed int4
weights). --graphs: decode through the CUDA graphs, as the engine runs by default (the profiler
still sees each kernel of a replayed graph), for the share of each kernel in the real step.

Prints the top kernels (total ms over the profiled steps, share of GPU time, calls) and writes
them as JSON with the profiled decode steps' wall time. With programmatic dependent launch
(kernels/pdl.py) a kernel starts while its predecessor runs and its duration includes the wait,
so the sums overlap; the JSON's "critical_path" charges each kernel only the time from the end
of everything before it to its own end, plus the device's idle time between kernels
(engine/profiler.critical_path): that is where the wall time of a step goes."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32, help="decode steps profiled (after a warm-up run)")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--awq", action="store_true", help="AWQ int4 weights (W11-awq's model directory)")
    ap.add_argument("--group-size", type=int, default=128, help="--awq: the quantization group (tiny models: 32)")
    ap.add_argument("--fp8", action="store_true", help="FP8 weights quantized at load and an FP8 KV cache (W11-fp8)")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs on (default: eager, every launch itemised)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep-trace", action="store_true",
                    help="keep the Chrome trace (host and device events) gzipped beside --out")
    args = ap.parse_args()

    from minivllm import LLM, SamplingParams
    from minivllm.bench import model_dirs
    from minivllm.engine.profiler import critical_path, device_events, export_trace, kernel_times
    quant = model_dirs.awq_quantization_config(args.group_size) if args.awq else None
    model_dir = model_dirs.write_model_dir(args.model_config, quantization_config=quant)
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=not args.graphs,
              batch_invariant=args.batch_invariant, max_model_len=args.prompt_len + args.max_tokens + 16,
              max_num_seqs=max(args.batch, 1),
              **({"quantization": "fp8", "kv_cache_dtype": "fp8"} if args.fp8 else {}))
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(args.prompt_len)]} for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles every kernel
    cuda = torch.cuda.is_available()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    rows = kernel_times(prof)
    total = sum(r["ms"] for r in rows)
    trace = (args.out or "kernel_profile.json") + ".trace.json"
    export_trace(prof, trace)
    crit = critical_path(device_events(trace))
    if args.keep_trace:
        import gzip
        import shutil
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    os.remove(trace)
    print(f"{args.model_config} batch {args.batch} bi={args.batch_invariant}: wall {wall * 1000:.1f} ms for "
          f"prefill + {args.max_tokens} decode steps, GPU kernel time {total:.1f} ms")
    for r in rows[:args.top]:
        print(f"{r['ms']:10.2f} ms {100 * r['share']:5.1f} % {r['calls']:7d}  {r['kernel']}")
    print(f"critical path: span {crit['span_ms']:.2f} ms, device idle {crit['idle_ms']:.2f} ms; exclusive time:")
    for r in crit["kernels"][:args.top]:
        print(f"{r['ms']:10.2f} ms {100 * r['share']:5.1f} % {r['calls']:7d}  {r['kernel']}")
    print("device idle, by the kernels around it:")
    for r in crit["idle_between"]:
        print(f"{r['ms']:10.2f} ms {r['count']:7d}  {r['after']} -> {r['before']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "wall_ms": round(wall * 1000, 2), "kernel_ms": round(total, 2),
                       "device": torch.cuda.get_device_name() if cuda else "cpu", "kernels": rows,
                       "critical_path": crit}, f, indent=1)


if __name__ == "__main__":
    main()
