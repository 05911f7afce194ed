"""Time the FP8 GEMM variants torch._scaled_mm offers on Qwen3-8B's linear shapes (issue 25:
which one W1-8B with FP8 weights should use), beside the bf16 GEMM, on one GPU:

    python3 scripts/fp8_gemm_sweep.py [--out sweep.json]

Variants: row-wise scales (per token x per output channel: what minivllm's fp8_linear uses)
with and without fast accumulation, one scale per tensor with and without it, and bf16.
Prints one line per (shape, M) with microseconds per GEMM and writes them all as JSON."""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # (N, K)
ROWS = [1, 64, 256, 512, 2048, 8192]


def time_us(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def variants(m: int, n: int, k: int) -> dict:
    dev, f8 = "cuda", torch.float8_e4m3fn
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    xq, wq = x.to(f8), w.to(f8)
    sx_row, sw_row = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)
    one = torch.ones((), device=dev)
    mm = torch._scaled_mm
    return {
        "bf16": lambda: x @ w.t(),
        "row": lambda: mm(xq, wq.t(), scale_a=sx_row, scale_b=sw_row, out_dtype=torch.bfloat16),
        "row_fast": lambda: mm(xq, wq.t(), scale_a=sx_row, scale_b=sw_row, out_dtype=torch.bfloat16,
                               use_fast_accum=True),
        "tensor": lambda: mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "tensor_fast": lambda: mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                  use_fast_accum=True),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        for m in ROWS:
            rec = {"shape": name, "m": m, "n": n, "k": k}
            for variant, fn in variants(m, n, k).items():
                try:
                    rec[variant] = round(time_us(fn), 2)
                except RuntimeError as e:  # a variant this torch/cuBLAS lacks
                    rec[variant] = f"error: {str(e).splitlines()[0][:80]}"
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
