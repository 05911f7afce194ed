"""Batch-invariant GEMM sweep (issue 22): the fixed-tile Triton matmul (kernels/invariant_gemm.py)
against cuBLAS and against other launches of the same kernel, on Qwen3-0.6B's linears (W1's
model) at decode and prefill row counts.

Two questions per (shape, rows):
- how fast is each launch (median us a call in a CUDA graph, weights cycled through copies
  that exceed the L2, as kernels/../bench/gpu_timing.py does for the GEMVs);
- does it give the same bits as the engine's launch (`same_bits`)? The engine's launch is
  batch-invariant by construction; a launch with the same bits on every shape and row count
  could be chosen by the row count without breaking the invariance (the K loop and its split
  stay those of the weight), which is what this measures before any such change.

    python3 scripts/bench_invariant_gemm.py --out inv-gemm.json          # ~3 minutes on an H100
    python3 scripts/bench_invariant_gemm.py --dry-run                    # shapes and launches only
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minivllm.bench.gpu_timing import copies_for, time_graph  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "minivllm", "bench", "configs",
                      "qwen3-0.6b", "config.json")
ROWS = (1, 16, 64, 128, 256, 512, 4096)


def shapes() -> dict[str, tuple[int, int]]:
    """Qwen3-0.6B's linears: name -> (K, N), the LM head included."""
    with open(CONFIG) as f:
        c = json.load(f)
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * c["intermediate_size"]),
            "down": (c["intermediate_size"], h), "lm_head": (h, c["vocab_size"])}


def launches(bn: int) -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) to try, the engine's first, for a weight whose
    fixed tile width is bn."""
    out = [(64, bn, 64, 4, 3), (64, bn, 64, 4, 4), (64, bn, 64, 4, 5), (64, bn, 128, 4, 3), (64, bn, 128, 4, 4),
           (64, bn, 64, 8, 3), (128, bn, 64, 4, 3), (128, bn, 64, 8, 3), (128, bn, 64, 8, 4), (16, bn, 64, 4, 4),
           (32, bn, 64, 4, 4), (16, bn, 128, 4, 4), (64, 2 * bn, 64, 4, 3), (128, 2 * bn, 64, 8, 3),
           (128, 256, 64, 8, 3), (64, 32, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4)]
    seen, unique = set(), []
    for t in out:
        if t not in seen and t[1] >= 16:
            seen.add(t)
            unique.append(t)
    return unique


def sweep(name: str, k: int, n: int, rows: int) -> dict:
    import torch.nn.functional as F

    from minivllm.kernels import invariant_gemm as ig
    from minivllm.kernels.device import num_sms
    dtype = torch.bfloat16
    copies = copies_for(2 * k * n)
    ws = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    base = ig.invariant_matmul(x, ws[0])
    one = ig.invariant_matmul(x[:1].contiguous(), ws[0])
    assert torch.equal(one, base[:1]), f"{name} rows {rows}: the engine's launch is not batch-invariant"
    bn = ig.block_n_for(n, num_sms(x.device))
    out = {"shape": name, "K": k, "N": n, "rows": rows, "split_k": ig.split_k_for(n, k, num_sms(x.device)),
           "cublas_us": time_graph(lambda i: F.linear(x, ws[i]), copies), "launches": []}
    for t in launches(bn):
        try:
            got = ig.invariant_matmul(x, ws[0], tile=t)
            same = bool(torch.equal(got, base))
            err = (got.float() - base.float()).abs().max().item()
            us = time_graph(lambda i, t=t: ig.invariant_matmul(x, ws[i], tile=t), copies)
        except Exception as e:  # noqa: BLE001 - a launch the compiler refuses (shared memory): skip it
            print(f"{name} rows {rows} {t}: failed ({type(e).__name__}: {e})"[:200], flush=True)
            continue
        out["launches"].append({"tile": list(t), "us": us, "same_bits": same, "max_abs_diff": err})
    engine = out["launches"][0]
    same = [r for r in out["launches"] if r["same_bits"]]
    best_same = min(same, key=lambda r: r["us"])
    best_any = min(out["launches"], key=lambda r: r["us"])
    out.update(engine_us=engine["us"], best_same=best_same, best_any=best_any)
    print(f"{name:8s} K {k:5d} N {n:6d} rows {rows:5d} split {out['split_k']}: cuBLAS {out['cublas_us']:8.2f} "
          f"engine {engine['us']:8.2f} best same-bits {best_same['us']:8.2f} {best_same['tile']} best any "
          f"{best_any['us']:8.2f} {best_any['tile']} (same bits: {sum(r['same_bits'] for r in out['launches'])}/"
          f"{len(out['launches'])})", flush=True)
    del ws
    torch.cuda.empty_cache()
    return out


def step_totals(records: list[dict], layers: int) -> dict:
    """Per decode step at each row count: the linears of all layers plus the LM head (ms)."""
    totals = {}
    for rows in ROWS:
        rs = [r for r in records if r["rows"] == rows]
        if len(rs) < 5:
            continue
        mult = {r["shape"]: (1 if r["shape"] == "lm_head" else layers) for r in rs}
        totals[rows] = {key: sum(mult[r["shape"]] * (r[key] if key.endswith("_us") else r[key]["us"]) for r in rs) / 1e3
                        for key in ("cublas_us", "engine_us", "best_same", "best_any")}
        print(f"rows {rows:5d} step ms: cuBLAS {totals[rows]['cublas_us']:.3f} engine {totals[rows]['engine_us']:.3f} "
              f"best same-bits {totals[rows]['best_same']:.3f} best any {totals[rows]['best_any']:.3f}", flush=True)
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    with open(CONFIG) as f:
        layers = json.load(f)["num_hidden_layers"]
    if args.dry_run:
        for name, (k, n) in shapes().items():
            print(name, k, n, launches(64))
        return
    records = []
    for rows in ROWS:
        for name, (k, n) in shapes().items():
            if name == "lm_head" and rows > 512:
                continue  # the engine runs the LM head on the sampled rows only
            records.append(sweep(name, k, n, rows))
    result = {"device": torch.cuda.get_device_name(0), "records": records, "step_ms": step_totals(records, layers)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
