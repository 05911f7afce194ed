"""Batch-invariant GEMM sweep (issue 22): the fixed-tile Triton matmul (kernels/invariant_gemm.py)
against cuBLAS and against other launches of the same kernel, on Qwen3-0.6B's linears (W1's
model) at decode and prefill row counts.

Two questions per (shape, rows):
- how fast is each launch (median us a call in a CUDA graph, weights cycled through copies
  that exceed the L2, as kernels/../bench/gpu_timing.py does for the GEMVs);
- does it give the same bits as the fixed launch (`same_bits`; the one launch every row count
  used before the table)? The fixed launch is batch-invariant by construction; launches with the
  same bits at every shape and row count can be chosen by the row count without breaking the
  invariance (the weight's K slices stay), which kernels/invariant_gemm.launch_for does from the
  table --write-from keeps (lease 27, 2026-11-27: all 17 launches tried gave the same bits).

    python3 scripts/bench_invariant_gemm.py --out inv-gemm.json          # ~5 minutes on an H100
    python3 scripts/bench_invariant_gemm.py --dry-run                    # shapes and launches only
    python3 scripts/bench_invariant_gemm.py --write-from inv-gemm.json   # keep the table (no GPU)
    python3 scripts/bench_invariant_gemm.py --splits 1,2,4 --out s.json  # also other K slices for o/down

With --splits, the narrow weights (those split_k_for cuts) are swept at each count too, and the
table keeps, per weight, the count with the least W1-weighted time (choose_splits): the K slices
are then the table's for that weight on that GPU (split_k_for reads them), which changes the
mode's bits there, once, not its invariance.
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
ROWS = (1, 16, 32, 64, 128, 192, 256, 384, 512, 2048, 8192)


def shapes() -> dict[str, tuple[int, int]]:
    """Qwen3-0.6B's linears: name -> (K, N), the LM head included."""
    with open(CONFIG) as f:
        c = json.load(f)
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * c["intermediate_size"]),
            "down": (c["intermediate_size"], h), "lm_head": (h, c["vocab_size"])}


def launches(bn: int, split: int) -> list[tuple[tuple[int, int, int, int, int], bool]]:
    """(tile, in_program) launches to try, the fixed launch first, for a weight whose fixed tile
    width is bn and whose K is cut in `split` slices; tile = (BLOCK_M, BLOCK_N, BLOCK_K, warps,
    stages). The list keeps every launch within 3 % of the best somewhere in lease 28's sweep of 23
    tiles, plus deeper pipelines of the 128-wide K steps."""
    tiles = [(64, bn, 64, 4, 3), (64, bn, 128, 4, 4), (16, bn, 128, 4, 4), (64, bn, 128, 4, 3), (64, bn, 128, 8, 4),
             (64, bn, 64, 4, 4), (64, bn, 64, 4, 5), (128, bn, 64, 8, 4), (32, bn, 128, 4, 4), (128, bn, 64, 8, 3),
             (16, bn, 256, 4, 3), (64, bn, 64, 8, 3), (128, bn, 64, 4, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4),
             (128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 4), (64, 32, 64, 4, 4), (64, 64, 64, 4, 3),
             (64, 128, 64, 4, 3), (64, bn, 128, 4, 5), (16, bn, 128, 4, 5), (32, bn, 128, 4, 5)]
    out, seen = [], set()
    for t in tiles:
        for in_program in ((False, True) if split > 1 else (False,)):
            if (t, in_program) not in seen and t[1] >= 16:
                seen.add((t, in_program))
                out.append((t, in_program))
    return out


def sweep(name: str, k: int, n: int, rows: int, split: int) -> dict:
    """Every launch of one weight at one row count with the weight's K cut in `split` slices."""
    import torch.nn.functional as F

    from minivllm.kernels import invariant_gemm as ig
    from minivllm.kernels.device import num_sms
    dtype = torch.bfloat16
    copies = copies_for(2 * k * n)
    ws = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    fixed = ig.fixed_launch(n, num_sms(x.device))
    base = ig.invariant_matmul(x, ws[0], tile=fixed, split=split)
    one = ig.invariant_matmul(x[:1].contiguous(), ws[0], tile=fixed, split=split)
    assert torch.equal(one, base[:1]), f"{name} rows {rows}: the fixed launch is not batch-invariant"
    bn = ig.block_n_for(n, num_sms(x.device))
    out = {"shape": name, "K": k, "N": n, "rows": rows, "split_k": split,
           "cublas_us": time_graph(lambda i: F.linear(x, ws[i]), copies), "launches": []}
    for t, in_program in launches(bn, split):
        try:
            got = ig.invariant_matmul(x, ws[0], tile=t, in_program=in_program, split=split)
            same = bool(torch.equal(got, base))
            err = (got.float() - base.float()).abs().max().item()
            us = time_graph(
                lambda i, t=t, p=in_program: ig.invariant_matmul(x, ws[i], tile=t, in_program=p, split=split), copies)
        except Exception as e:  # noqa: BLE001 - a launch the compiler refuses (shared memory): skip it
            print(f"{name} rows {rows} {t} {in_program}: failed ({type(e).__name__}: {e})"[:200], flush=True)
            continue
        out["launches"].append({"tile": list(t), "in_program": in_program, "us": us, "same_bits": same,
                                "max_abs_diff": err})
    fixed_run = out["launches"][0]
    same = [r for r in out["launches"] if r["same_bits"]]
    best_same = min(same, key=lambda r: r["us"])
    best_any = min(out["launches"], key=lambda r: r["us"])
    out.update(fixed_us=fixed_run["us"], best_same=best_same, best_any=best_any)
    show = lambda r: f"{r['us']:8.2f} {r['tile']} {r['in_program']}"  # noqa: E731
    print(f"{name:8s} K {k:5d} N {n:6d} rows {rows:5d} split {out['split_k']}: cuBLAS {out['cublas_us']:8.2f} "
          f"fixed {fixed_run['us']:8.2f} best same-bits {show(best_same)} best any {show(best_any)} "
          f"(same bits: {len(same)}/{len(out['launches'])})", flush=True)
    del ws
    torch.cuda.empty_cache()
    return out


def step_totals(records: list[dict], layers: int) -> dict:
    """Per decode step at each row count: the linears of all layers plus the LM head (ms), each
    weight with the K slices the table would keep (choose_splits)."""
    totals = {}
    keep = choose_splits(records)
    for rows in ROWS:
        rs = [r for r in records if r["rows"] == rows and r["split_k"] == keep[r["shape"]]]
        if len(rs) < 5:
            continue
        mult = {r["shape"]: (1 if r["shape"] == "lm_head" else layers) for r in rs}
        totals[rows] = {key: sum(mult[r["shape"]] * (r[key] if key.endswith("_us") else r[key]["us"]) for r in rs) / 1e3
                        for key in ("cublas_us", "fixed_us", "best_same", "best_any")}
        print(f"rows {rows:5d} step ms: cuBLAS {totals[rows]['cublas_us']:.3f} fixed {totals[rows]['fixed_us']:.3f} "
              f"best same-bits {totals[rows]['best_same']:.3f} best any {totals[rows]['best_any']:.3f}", flush=True)
    return totals


# W1's decode steps by batch size (each request's output is U[100, 1024] tokens, so after the first
# ~100 steps the batch falls about evenly from 256 to 0 over ~920 steps), and its prefill work
# (~143k prompt tokens, in chunks of thousands of rows): the weights that choose a weight's K
# slices from the sweep's row counts (a row count's best launch times its weight, summed)
W1_WEIGHTS = {1: 10, 16: 60, 32: 115, 64: 230, 128: 230, 192: 230, 256: 190, 2048: 10, 8192: 15}


def choose_splits(records: list[dict]) -> dict[str, int]:
    """shape -> the K slices with the least W1-weighted time over the row counts all the swept
    slice counts have (one count when only one was swept)."""
    by: dict[str, dict[int, dict[int, float]]] = {}
    for r in records:
        by.setdefault(r["shape"], {}).setdefault(r["split_k"], {})[r["rows"]] = r["best_same"]["us"]
    keep = {}
    for shape, splits in by.items():
        common = set.intersection(*(set(rows) for rows in splits.values()))
        keep[shape] = min(splits, key=lambda s: sum(W1_WEIGHTS.get(m, 0) * splits[s][m] for m in common))
    return keep


def write_table(result: dict) -> str:
    """Keep the sweep: for each weight, the fastest same-bits launch at each row count measured
    (kernels/configs/invariant_gemm/<GPU>.json, read by invariant_gemm.launch_for). The weights
    this sweep did not cover keep their entries."""
    from minivllm.kernels.invariant_gemm import CONFIG_DIR
    from minivllm.kernels.tuned_tables import read_table, table_file
    path = table_file(CONFIG_DIR, result["device"])
    table: dict[str, dict] = read_table(path)
    for key in {f"N={r['N']},K={r['K']}" for r in result["records"]}:
        table.pop(key, None)
    keep = choose_splits(result["records"])
    for r in sorted(result["records"], key=lambda r: r["rows"]):
        if r["split_k"] != keep[r["shape"]]:
            continue
        entry = table.setdefault(f"N={r['N']},K={r['K']}", {"label": f"qwen3-0.6b:{r['shape']}",
                                                              "split_k": r["split_k"], "rows": []})
        best = r["best_same"]
        entry["rows"].append([r["rows"], best["tile"], best["in_program"]])
        entry.setdefault("us", []).append({"rows": r["rows"], "fixed": round(r["fixed_us"], 2),
                                            "table": round(best["us"], 2), "cublas": round(r["cublas_us"], 2)})
    os.makedirs(CONFIG_DIR, exist_ok=True)
    entries = [f' "{key}": {{"label": "{e["label"]}", "split_k": {e.get("split_k", 1)},\n'
               f'  "rows": {json.dumps(e["rows"])},\n  "us": {json.dumps(e["us"])}}}' for key, e in table.items()]
    with open(path, "w") as f:  # a weight to a few lines: rows [max_rows, tile, in_program], us the sweep's times
        f.write("{\n" + ",\n".join(entries) + "\n}\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--write-from", metavar="JSON", help="no GPU: keep the launch table of a sweep's --out file")
    ap.add_argument("--splits", default="", help="K slice counts to sweep for the weights that split K "
                    "(e.g. 1,2,4; default: only the count split_k_for derives)")
    ap.add_argument("--shapes", default="", help="only these weights (e.g. o,down)")
    ap.add_argument("--rows", default="", help="only these row counts (e.g. 64,256)")
    args = ap.parse_args()
    if args.write_from:
        with open(args.write_from) as f:
            print("wrote", write_table(json.load(f)))
        return
    with open(CONFIG) as f:
        layers = json.load(f)["num_hidden_layers"]
    if args.dry_run:
        for name, (k, n) in shapes().items():
            print(name, k, n, launches(64, 4))
        return
    from minivllm.kernels.invariant_gemm import split_k_for
    from minivllm.kernels.device import num_sms
    sms = num_sms(torch.device("cuda"))
    rows_list = [int(r) for r in args.rows.split(",")] if args.rows else ROWS
    records = []
    for rows in rows_list:
        for name, (k, n) in shapes().items():
            if (args.shapes and name not in args.shapes.split(",")) or (name == "lm_head" and rows > 512):
                continue  # (the engine runs the LM head on the sampled rows only)
            derived = split_k_for(n, k, sms)
            splits = [int(v) for v in args.splits.split(",")] if args.splits and derived > 1 else [derived]
            for split in splits:
                records.append(sweep(name, k, n, rows, split))
    result = {"device": torch.cuda.get_device_name(0), "records": records, "step_ms": step_totals(records, layers)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
