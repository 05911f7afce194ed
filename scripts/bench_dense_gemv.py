"""Batch-1 dense GEMV sweep (issue 21): the Triton GEMV (kernels/dense_gemv.py) against cuBLAS
(F.linear) on the decoder linears of the benchmark models, bf16 x [1, K], W [N, K].

Each (tile, split-K) is timed as the engine's decode graphs see it: the median over RUNS replays
of one CUDA graph of GRAPH_CALLS calls, divided by GRAPH_CALLS, cycling through copies of the
weight that together exceed 4x the 50 MB L2 (the weights stream from HBM as in a real step).

    python3 scripts/bench_dense_gemv.py --dry-run                  # shapes only, no GPU
    python3 scripts/bench_dense_gemv.py --out sweep.json --write   # sweep; keep the table

--write stores the best tile per shape with both times in kernels/configs/dense_gemv/<GPU>.json,
which the engine reads (a layer takes the GEMV only where it beat cuBLAS there). --models
limits the shapes (default: every model below). A full sweep takes about 3 minutes on an H100.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minivllm.bench.gpu_timing import copies_for  # noqa: E402
from minivllm.bench.gpu_timing import time_graph as _time_graph  # noqa: E402


def time_graph(fn, copies: int) -> float:
    return _time_graph(fn, copies, RUNS, GRAPH_CALLS)

RUNS = 30
GRAPH_CALLS = 32
SPLITS = (1, 2, 4, 8, 16)
# (BLOCK_N, BLOCK_K, num_warps): narrow row tiles, long 16-byte loads along K
TILES = [(4, 512, 2), (8, 256, 4), (8, 512, 4), (16, 128, 2), (16, 256, 4), (16, 512, 4), (32, 256, 4),
         (32, 512, 8), (64, 128, 4), (4, 1024, 4), (8, 1024, 8), (4, 2048, 8)]
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "minivllm", "bench", "configs")
MODELS = ["qwen3-30b-a3b", "llama-3.1-8b", "qwen3-8b", "qwen3-0.6b", "smollm2-135m"]


def gb_per_s(k: int, n: int, us: float) -> float:
    """GB/s of reading a bf16 [n, k] weight in `us` microseconds."""
    return 2 * k * n / us / 1e3


def model_shapes(name: str) -> dict[str, tuple[int, int]]:
    """The decoder's dense linears of a model config: name -> (K, N)."""
    with open(os.path.join(CONFIG_DIR, name, "config.json")) as f:
        c = json.load(f)
    h = c["hidden_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c.get("num_key_value_heads", c["num_attention_heads"]) * hd
    shapes = {"qkv": (h, q + 2 * kv), "o": (q, h)}
    if c.get("num_experts"):
        shapes["router"] = (h, c["num_experts"])
    else:
        shapes["gate_up"] = (h, 2 * c["intermediate_size"])
        shapes["down"] = (c["intermediate_size"], h)
    return shapes


def sweep_shape(k: int, n: int, label: str) -> dict:
    """cuBLAS's time and every (tile, split)'s for one shape; the best tile, checked against F.linear."""
    import torch.nn.functional as F

    from minivllm.kernels.dense_gemv import dense_gemv
    dtype = torch.bfloat16
    copies = copies_for(2 * k * n)
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    ws = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    cublas = time_graph(lambda i: F.linear(x, ws[i]), copies)
    rows = []
    for bn, bk, warps in TILES:
        for split in (s for s in SPLITS if s <= max(1, k // bk)):
            tile = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": 3}
            try:
                got = dense_gemv(x, ws[0], None, tile, split)
                ref = F.linear(x.float(), ws[0].float())
                err = (got.float() - ref).abs().max().item()
                if err > 1e-2 * ref.abs().max().item() + 1e-3:
                    print(f"{label} {tile} split {split}: WRONG (max err {err:.3g})", flush=True)
                    continue
                us = time_graph(lambda i, tile=tile, split=split: dense_gemv(x, ws[i], None, tile, split), copies)
            except Exception as e:  # noqa: BLE001 - a tile the compiler refuses: skip it
                print(f"{label} {tile} split {split}: failed ({type(e).__name__}: {e})"[:200], flush=True)
                continue
            rows.append({"tile": tile, "split_k": split, "us": us})
    best = min(rows, key=lambda r: r["us"])
    gbps = functools.partial(gb_per_s, k, n)
    print(f"{label:22s} K {k:6d} N {n:6d}: cuBLAS {cublas:7.2f} us ({gbps(cublas):5.0f} GB/s), GEMV best "
          f"{best['us']:7.2f} us ({gbps(best['us']):5.0f} GB/s) {best['tile']} split {best['split_k']}: "
          f"{cublas / best['us']:.2f}x", flush=True)
    del ws
    torch.cuda.empty_cache()
    return {"label": label, "K": k, "N": n, "cublas_us": cublas, "best": best, "all": rows,
            "cublas_GBps": gbps(cublas), "gemv_GBps": gbps(best["us"])}


STREAM_TILES = [{"BLOCK_N": bn, "num_warps": w, "programs_per_sm": pps} for bn in (1, 2, 4) for w in (4, 8)
                for pps in (2, 4)]


def stream_shape(k: int, n: int, label: str) -> dict:
    """--stream: the table's tile (the engine's GEMV today), cuBLAS, and the streaming kernel's
    tiles (kernels/dense_gemv.dense_gemv_stream) on one shape with K <= STREAM_MAX_K."""
    import torch.nn.functional as F

    from minivllm.kernels import dense_gemv as dg
    dtype = torch.bfloat16
    copies = copies_for(2 * k * n)
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    ws = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    ref = F.linear(x.float(), ws[0].float())
    out = {"label": label, "K": k, "N": n, "cublas_us": time_graph(lambda i: F.linear(x, ws[i]), copies)}
    tile = dg.pick_tile(n, k, dtype, torch.cuda.get_device_name(0), "on")
    split = tile.pop("SPLIT_K", None)
    out["gemv_us"] = time_graph(lambda i: dg.dense_gemv(x, ws[i], None, tile, split), copies)
    rows = []
    for t in STREAM_TILES:
        err = (dg.dense_gemv_stream(x, ws[0], None, t).float() - ref).abs().max().item()
        if err > 1e-2 * ref.abs().max().item() + 1e-3:
            print(f"{label} {t}: WRONG (max err {err:.3g})", flush=True)
            continue
        rows.append({"tile": t, "us": time_graph(lambda i, t=t: dg.dense_gemv_stream(x, ws[i], None, t), copies)})
    out["stream_best"] = min(rows, key=lambda r: r["us"])
    out["stream_all"] = rows
    gbps = functools.partial(gb_per_s, k, n)
    print(f"{label:22s} K {k:6d} N {n:6d}: cuBLAS {out['cublas_us']:7.2f} us, GEMV {out['gemv_us']:7.2f} us "
          f"({gbps(out['gemv_us']):5.0f} GB/s), stream best {out['stream_best']['us']:7.2f} us "
          f"({gbps(out['stream_best']['us']):5.0f} GB/s) {out['stream_best']['tile']}", flush=True)
    del ws
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--write", action="store_true", help="keep the best tiles in kernels/configs/dense_gemv/")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--stream", action="store_true",
                    help="time the streaming GEMV's tiles against the table's tile and cuBLAS (K <= 4096 only)")
    args = ap.parse_args()
    shapes: dict[tuple[int, int], str] = {}
    for model in args.models.split(","):
        for name, kn in model_shapes(model).items():
            shapes.setdefault(kn, f"{model}:{name}")
    for (k, n), label in shapes.items():
        print(f"  {label:22s} K {k:6d} -> N {n:6d}: {2 * k * n / 1e6:7.2f} MB x {copies_for(2 * k * n)} copies")
    if args.dry_run:
        return
    from minivllm.kernels.dense_gemv import config_file, shape_key, stream_fits
    torch.manual_seed(0)
    device = torch.cuda.get_device_name(0)
    if args.stream:
        results = [stream_shape(k, n, label) for (k, n), label in shapes.items() if stream_fits(k)]
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": device, "results": results}, f, indent=1)
        return
    results = [sweep_shape(k, n, label) for (k, n), label in shapes.items()]
    report = {"device": device, "runs": RUNS, "graph_calls": GRAPH_CALLS, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.write:
        path = config_file(device)
        table = {}
        if os.path.isfile(path):
            with open(path) as f:
                table = json.load(f)
        for r in results:
            tile = dict(r["best"]["tile"], SPLIT_K=r["best"]["split_k"])
            table[shape_key(r["N"], r["K"], torch.bfloat16)] = {
                "tile": tile, "gemv_us": round(r["best"]["us"], 3), "cublas_us": round(r["cublas_us"], 3),
                "label": r["label"]}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        print(f"wrote {len(results)} shapes to {path}")
    total_c = sum(r["cublas_us"] for r in results)
    total_g = sum(min(r["cublas_us"], r["best"]["us"]) for r in results)
    print(f"sum over the shapes: cuBLAS {total_c:.1f} us, best of the two {total_g:.1f} us")


if __name__ == "__main__":
    main()
