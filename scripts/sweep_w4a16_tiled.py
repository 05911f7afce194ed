"""Tile sweep of the several-row W4A16 GEMM (kernels/w4a16_gemm.py `_w4a16_kernel`: prefill and
batched decode) on the GPU, Llama-3.1-8B's linear shapes, AWQ group 128, float16 activations (W11).
Each candidate launch (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, K slices)
is compiled once and timed on the four weights (triton.testing.do_bench, median), beside
dequantize + cuBLAS (the path at DENSE_MIN_ROWS rows and more) and cuBLAS on the float16 weight
(the ceiling: same product, 4x the weight bytes, no dequantization).

    python3 scripts/sweep_w4a16_tiled.py --rows 128,32 [--budget-s 170] [--write] [--out sweep.json]

--write keeps each weight's fastest launch per row count in kernels/configs/w4a16_tiled/<GPU>.json
(read by w4a16_gemm.tiled_launch; a sibling GPU borrows it, kernels/tuned_tables.py)."""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
GROUP = 128


def candidates(m: int):
    """Launches worth timing for m rows, likeliest first. Lease 44 (H200): 4 warps won every weight
    at 32 and 128 rows; at 128 rows BLOCK_N 128 without K slices left o and down at 64 programs
    on 132 SMs (down 218 us, dequant + cuBLAS 87), so K slices and BLOCK_N 64 are candidates
    there too (lease 45: down 80 us at BLOCK_N 64, 4 slices)."""
    bms = [b for b in (16, 32, 64, 128) if m // 2 <= b <= max(16, m)] or [16]
    for bk, bm, bn, split in itertools.product((128, 64), bms, (128, 64), (2, 1, 4)):
        yield {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": 3}, split


def bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3  # us


def weights(n: int, k: int):
    from minivllm.quant import w4
    q = torch.randint(0, 16, (k, n), device="cuda")
    s = torch.rand(k // GROUP, n, device="cuda", dtype=torch.float16) * 0.01 + 0.001
    z = torch.randint(0, 16, (k // GROUP, n), device="cuda").half()
    return w4.pack_engine(q), s, z


def sweep_rows(m: int, ws: dict, deadline: float) -> dict:
    from minivllm.kernels.w4a16_gemm import w4a16_dequantize, w4a16_gemm
    xs = {name: torch.randn(m, k, device="cuda", dtype=torch.float16) for name, (n, k) in SHAPES.items()}
    out = {name: {"tiles": []} for name in SHAPES}
    refs = {}
    for name, (qw, s, z) in ws.items():
        weight = w4a16_dequantize(qw, s, z, GROUP, torch.float16)
        out[name]["dense_us"] = bench(lambda: xs[name] @ w4a16_dequantize(qw, s, z, GROUP, torch.float16))
        out[name]["cublas_fp16_us"] = bench(lambda: xs[name] @ weight)  # noqa: B023 (timed here, in the loop)
        refs[name] = xs[name].float() @ weight.float()
    for cfg, split in candidates(m):
        if time.time() > deadline:
            print(f"M={m}: budget spent", flush=True)
            break
        for name, (qw, s, z) in ws.items():
            try:
                y = w4a16_gemm(xs[name], qw, s, z, GROUP, split, dict(cfg))
                us = bench(lambda: w4a16_gemm(xs[name], qw, s, z, GROUP, split, dict(cfg)))
            except Exception as e:  # noqa: BLE001 - a tile the compiler refuses (shared memory): skip it
                print(f"M={m} {name} {cfg} split {split}: failed ({type(e).__name__})", flush=True)
                break
            err = ((y.float() - refs[name]).norm() / refs[name].norm()).item()
            if not err < 1e-2:  # never keep a launch that computes something else
                print(f"M={m} {name} {cfg} split {split}: wrong result (relative error {err:.3g})", flush=True)
                break
            out[name]["tiles"].append({"cfg": cfg, "split_k": split, "us": us})
        else:
            print(f"M={m} {cfg} split {split}: " + ", ".join(f"{n} {out[n]['tiles'][-1]['us']:.1f}" for n in SHAPES),
                  flush=True)
    for name, row in out.items():
        if row["tiles"]:
            best = min(row["tiles"], key=lambda t: t["us"])
            row["best"] = best
            print(f"M={m:4d} {name:8s} best {best['us']:8.1f} us {best['cfg']} split {best['split_k']}; "
                  f"dequant+cuBLAS {row['dense_us']:8.1f} us; cuBLAS fp16 weight {row['cublas_fp16_us']:8.1f} us",
                  flush=True)
    return out


def write_table(results: dict, device: str) -> str:
    """Each weight's fastest launch per row count -> kernels/configs/w4a16_tiled/<GPU>.json:
    "N=..,K=..,G=.." -> {"rows": [[max_rows, config, split_k, us, dense_us], ...] rising}."""
    import os

    from minivllm.kernels.tuned_tables import read_table, table_file
    from minivllm.kernels.w4a16_gemm import TILED_CONFIG_DIR, gemv_key
    os.makedirs(TILED_CONFIG_DIR, exist_ok=True)
    path = table_file(TILED_CONFIG_DIR, device)
    table = read_table(path)
    for name, (n, k) in SHAPES.items():
        rows = {r[0]: r for r in table.get(gemv_key(n, k, GROUP), {}).get("rows", [])}
        for m, shapes in results.items():
            best = shapes[name].get("best")
            if best:
                rows[int(m)] = [int(m), best["cfg"], best["split_k"], round(best["us"], 2),
                                round(shapes[name]["dense_us"], 2)]
        table[gemv_key(n, k, GROUP)] = {"label": f"llama-3.1-8b:{name}", "rows": [rows[m] for m in sorted(rows)]}
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(f" {json.dumps(key)}: {json.dumps(v)}" for key, v in table.items()) + "\n}\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="128,32")
    p.add_argument("--budget-s", type=float, default=170)
    p.add_argument("--write", action="store_true", help="keep the best launches in this GPU's table")
    p.add_argument("--out", default=None, help="also write the results as JSON")
    args = p.parse_args()
    deadline = time.time() + args.budget_s
    torch.manual_seed(0)
    ws = {name: weights(n, k) for name, (n, k) in SHAPES.items()}
    results = {int(m): sweep_rows(int(m), ws, deadline) for m in args.rows.split(",")}
    device = torch.cuda.get_device_name(0)
    if args.write:
        print("kept:", write_table(results, device))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
