"""Tile sweep of the Triton W4A16 GEMM (kernels/w4a16_gemm.py) on the GPU, Llama-3.1-8B's linear
shapes, AWQ group 128: for each row count, every candidate tile config and split-K is timed
(triton.testing.do_bench, median) and the best is printed, with the weight-read bandwidth it
reaches and the time of the dequant + cuBLAS path (which decides DENSE_MIN_ROWS). The last lines
are a W4A16_CONFIGS table to paste into the kernel module.

    python3 scripts/sweep_w4a16.py [--rows 1,2,4,8,16,32,64,128,256] [--budget-s 500] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def weights(n: int, k: int, group: int = 128):
    from minivllm.quant import w4
    q = torch.randint(0, 16, (k, n), device="cuda")
    qw = w4.pack_engine(q)
    s = torch.rand(k // group, n, device="cuda", dtype=torch.float16) * 0.01
    z = torch.randint(0, 16, (k // group, n), device="cuda").half()
    return qw, s, z


def candidates(m: int, quick: bool):
    bms = ([1] if m <= 4 else []) + ([16] if m <= 16 else [b for b in (16, 32, 64) if b <= max(16, m)])  # 1: GEMV
    grid = itertools.product(bms, (32, 64, 128) if quick else (32, 64, 128, 256), (128, 256) if quick else (128, 256, 512),
                             (4,) if quick else (4, 8), (3,) if quick else (2, 3, 4), (1, 2, 4, 8, 16))
    for bm, bn, bk, warps, stages, split in grid:
        yield {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}, split


def bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3  # us


def sweep_rows(m: int, quick: bool, deadline: float) -> dict:
    from minivllm.kernels.w4a16_gemm import choose_split_k, w4a16_config, w4a16_dequantize, w4a16_gemm
    out = {}
    for name, (n, k) in SHAPES.items():
        qw, s, z = weights(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        best = (float("inf"), None, None)
        for cfg, split in candidates(m, quick):
            if time.time() > deadline:
                break
            try:
                t = bench(lambda: w4a16_gemm(x, qw, s, z, 128, split, cfg))
            except Exception:  # noqa: BLE001  (out of shared memory / registers: skip the config)
                continue
            best = min(best, (t, cfg, split), key=lambda b: b[0])
        cur_cfg = w4a16_config(m)
        cur_split = choose_split_k(m, n, k, cur_cfg, torch.cuda.get_device_properties(0).multi_processor_count)
        current = bench(lambda: w4a16_gemm(x, qw, s, z, 128))
        dense = bench(lambda: x @ w4a16_dequantize(qw, s, z, 128, x.dtype))
        wbytes = n * k / 2 + 2 * 2 * n * k / 128
        out[name] = {"best_us": best[0], "best_cfg": best[1], "best_split": best[2], "current_us": current,
                     "current_split": cur_split, "dense_us": dense, "best_weight_TBps": wbytes / best[0] / 1e6}
        print(f"M={m:4d} {name:8s} best {best[0]:8.1f} us {best[1]} split {best[2]} "
              f"({out[name]['best_weight_TBps']:.2f} TB/s of weights); current {current:8.1f} us (split {cur_split}); "
              f"dequant+cuBLAS {dense:8.1f} us", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--budget-s", type=float, default=500)
    p.add_argument("--quick", action="store_true", help="fewer candidates (a first look in one device call)")
    p.add_argument("--out", default=None, help="also write the results as JSON")
    args = p.parse_args()
    deadline = time.time() + args.budget_s
    results = {m: sweep_rows(m, args.quick, deadline) for m in (int(r) for r in args.rows.split(","))}
    print("\n# best config per row count (the most common best over the four shapes):")
    for m, shapes in results.items():
        cfgs = [json.dumps(v["best_cfg"], sort_keys=True) for v in shapes.values() if v["best_cfg"]]
        if cfgs:
            top = max(set(cfgs), key=cfgs.count)
            print(f"    ({m}, {top}),")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
