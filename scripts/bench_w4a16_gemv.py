"""Batch-1 W4A16 GEMV micro-benchmark (issue 25: AWQ decode), Llama-3.1-8B's linear shapes, group
128, bf16 x [1, K]: the Triton GEMV (kernels/w4a16_gemm.py, its batch-1 config) at each split-K
of SPLITS and at choose_split_k's default, and torch.matmul on a dense bf16 weight of the same
shape, for scale.

Two timings per variant, both with CUDA events after a warm-up:
    eager  median over RUNS single calls (launch cost partly included)
    graph  median over RUNS replays of one CUDA graph of GRAPH_CALLS calls, divided by
           GRAPH_CALLS: the kernel time as the engine's decode graphs see it
Each call uses the next of several copies of the weights (together over 4x L2_BYTES, as 32
layers are), so the weights stream from HBM as in a real decode step instead of sitting in the 50 MB L2.
GB/s: the int4 bytes one call reads (K*N/2 + bf16 scales and zeros, 2 * 2 * K/G * N) over the
graph time; the dense row also shows its own bf16 bytes.

    python3 scripts/bench_w4a16_gemv.py [--out gemv.json] [--dry-run]
    python3 scripts/bench_w4a16_gemv.py --tiles "64,256,4,3 128,256,4,3 128,512,8,3" --out tiles.json

--tiles: a sweep instead (graph times only): each "BLOCK_N,BLOCK_K,num_warps,num_stages" GEMV
tile at each split-K that leaves every program a K slice, per shape; prints the best per shape
and the per-token sum of the bests (what a tile per shape gives).
--write-from JSON (no GPU): keeps such a sweep's best (tile, split) per shape in the GEMV's table,
kernels/configs/w4a16_gemv/<GPU>.json, which w4a16_gemm reads for one or two rows of those weights.

--sequence default,kept,T.json: whole tokens instead: 32 layers' qkv, o, gate_up and down GEMVs
back to back in one CUDA graph (the model's 3.7 GB of weights) per GEMV table, as the engine's
decode graph runs them; the per-shape sweep times each GEMV alone and can rank tables otherwise.

--dry-run (no GPU needed) prints the shapes, their bytes, the default split-K (for an H100's
132 SMs unless a GPU is present) and the weight copies, and times nothing. A full run takes
about a minute, mostly Triton compiles; no network is used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
GROUP = 128
SPLITS = (1, 2, 4, 8, 16)
RUNS = 50
GRAPH_CALLS = 32
WARMUP = 5
L2_BYTES = 50 << 20  # H100's L2; the weight copies of a shape add up to more than 4x this
DTYPE = torch.bfloat16  # the activations' (and scales'); --fp16: AWQ checkpoints' float16, as W11-awq runs


def int4_bytes(k: int, n: int, group: int = GROUP) -> int:
    """What one call reads of the quantized weight: packed nibbles + bf16 scales and zeros."""
    return k * n // 2 + 2 * 2 * (k // group) * n


def copies_for(nbytes: int) -> int:
    """Weight copies cycled through so that together they exceed 4x the L2 (at most 64)."""
    from minivllm.bench.gpu_timing import copies_for as shared
    return shared(nbytes, L2_BYTES)


def plan(num_sms: int) -> list[dict]:
    """Per shape: sizes, bytes, copies and the splits to time (the default one named): the
    shape logic, device-free."""
    from minivllm.kernels.w4a16_gemm import choose_split_k, w4a16_config
    cfg = w4a16_config(1)
    rows = []
    for name, (k, n) in SHAPES.items():
        rows.append({"shape": name, "K": k, "N": n, "config": cfg, "int4_bytes": int4_bytes(k, n),
                     "dense_bytes": 2 * k * n, "copies": copies_for(int4_bytes(k, n)),
                     "dense_copies": copies_for(2 * k * n), "default_split": choose_split_k(1, n, k, cfg, num_sms),
                     "splits": list(SPLITS)})
    return rows


def weights(k: int, n: int, copies: int):
    """`copies` random (qweight [K/8, N] int32, scales, zeros [K/G, N] bf16) in the engine's layout
    (the scales and zeros interleaved, as the GPU loader stores them, unless GEMV_SZ_PAIRS is off)."""
    from minivllm.kernels.w4a16_gemm import gemv_scale_zero_layout
    out = []
    for _ in range(copies):
        words = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda")  # any 8 nibbles
        scales = (torch.rand(k // GROUP, n, device="cuda") * 0.01 + 0.001).to(DTYPE)
        zeros = torch.randint(0, 16, (k // GROUP, n), device="cuda").to(DTYPE)
        out.append((words, *gemv_scale_zero_layout(scales, zeros)))
    return out


def time_eager(fn, copies: int) -> float:
    """Median us of RUNS single calls (each between two events), cycling the weight copies."""
    for i in range(WARMUP):
        fn(i % copies)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(RUNS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(RUNS)]
    for i in range(RUNS):
        starts[i].record()
        fn(i % copies)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def time_graph(fn, copies: int) -> float:
    """Median us per call over RUNS replays of one graph of GRAPH_CALLS calls (copies cycled)."""
    from minivllm.bench.gpu_timing import time_graph as timed
    return timed(fn, copies, RUNS, GRAPH_CALLS)


def bench_shape(row: dict) -> list[dict]:
    from minivllm.kernels.w4a16_gemm import w4a16_gemm
    k, n = row["K"], row["N"]
    x = torch.randn(1, k, device="cuda", dtype=DTYPE)
    ws = weights(k, n, row["copies"])
    from minivllm.kernels.w4a16_gemm import w4a16_config
    # (label, split-K, packed half2 path): the splits on the default path, then both paths at the default split
    variants = [(f"gemv split {s}", s, None) for s in row["splits"]]
    variants += [(f"gemv plain default ({row['default_split']})", None, False),  # MINIVLLM_W4A16_GEMV_HALF2=0
                 (f"gemv half2 default ({row['default_split']})", None, True)]
    results = []
    for label, split, half2 in variants:
        def call(i: int, split=split, half2=half2) -> torch.Tensor:
            qw, s, z = ws[i]
            cfg = w4a16_config(1) if half2 is None else dict(w4a16_config(1), HALF2=half2)
            return w4a16_gemm(x, qw, s, z, GROUP, split_k=split, config=cfg)
        eager, graph = time_eager(call, row["copies"]), time_graph(call, row["copies"])
        results.append({"shape": row["shape"], "variant": label, "split_k": split or row["default_split"],
                        "eager_us": eager, "graph_us": graph, "int4_GBps": row["int4_bytes"] / graph / 1e3})
    del ws
    dense = [torch.randn(n, k, device="cuda", dtype=DTYPE) for _ in range(row["dense_copies"])]
    call = (lambda i: torch.matmul(x, dense[i].t()))
    eager, graph = time_eager(call, row["dense_copies"]), time_graph(call, row["dense_copies"])
    results.append({"shape": row["shape"], "variant": "dense bf16 matmul", "split_k": None, "eager_us": eager,
                    "graph_us": graph, "int4_GBps": row["int4_bytes"] / graph / 1e3,
                    "dense_GBps": row["dense_bytes"] / graph / 1e3})
    del dense
    torch.cuda.empty_cache()
    return results


def sweep_tiles(rows: list[dict], tiles: list[tuple[int, int, int, int]]) -> list[dict]:
    """Graph time of every (tile, split) per shape: [{shape, tile, split_k, graph_us, int4_GBps}]."""
    from minivllm.kernels.w4a16_gemm import w4a16_gemm
    results = []
    for row in rows:
        k, n = row["K"], row["N"]
        x = torch.randn(1, k, device="cuda", dtype=DTYPE)
        ws = weights(k, n, row["copies"])
        for bn, bk, warps, stages in tiles:
            cfg = {"BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
            for split in (sp for sp in SPLITS if sp <= k // bk):
                def call(i: int, split=split, cfg=cfg) -> torch.Tensor:
                    qw, sc, z = ws[i]
                    return w4a16_gemm(x, qw, sc, z, GROUP, split_k=split, config=cfg)
                try:
                    call(0)  # compile outside the timing (and the graph)
                    us = time_graph(call, row["copies"])
                except Exception as e:  # noqa: BLE001 - a tile the compiler refuses: skip it
                    print(f"{row['shape']:8s} {bn},{bk},{warps},{stages} split {split}: failed ({type(e).__name__})")
                    continue
                results.append({"shape": row["shape"], "tile": [bn, bk, warps, stages], "split_k": split,
                                "graph_us": us, "int4_GBps": row["int4_bytes"] / us / 1e3})
                print(f"{row['shape']:8s} tile {bn},{bk},{warps},{stages} split {split:2d}: {us:8.1f} us "
                      f"{row['int4_bytes'] / us / 1e3:7.0f} GB/s", flush=True)
        del ws
        torch.cuda.empty_cache()
    return results


LAYERS = 32  # Llama-3.1-8B's


def table_launches(rows: list[dict], table: dict | None) -> dict[str, tuple[dict, int]]:
    """shape -> (config, split) that a GEMV table (a kept-table dict; None: the defaults) gives."""
    from minivllm.kernels.w4a16_gemm import gemv_entry_launch, gemv_key
    out = {}
    for row in rows:
        cfg, split = gemv_entry_launch((table or {}).get(gemv_key(row["N"], row["K"], GROUP)))
        out[row["shape"]] = (cfg, split or row["default_split"])
    return out


def time_sequence(rows: list[dict], tables: dict[str, dict | None]) -> dict[str, float]:
    """A token's linears as the engine's decode graph runs them, per candidate table: LAYERS layers
    of their own weights (the model's 3.7 GB, so nothing stays in L2), each layer's qkv, o, gate_up
    and down GEMVs back to back in one graph (with PDL where the engine has it). ms a token. The
    per-shape sweep times each GEMV alone and can rank tables otherwise (lease 35)."""
    from minivllm.kernels.w4a16_gemm import w4a16_gemm
    xs = {r["shape"]: torch.randn(1, r["K"], device="cuda", dtype=DTYPE) for r in rows}
    layers = [{r["shape"]: weights(r["K"], r["N"], 1)[0] for r in rows} for _ in range(LAYERS)]
    out = {}
    for name, table in tables.items():
        launch = table_launches(rows, table)

        def layer(i: int, launch=launch) -> None:
            for shape, (cfg, split) in launch.items():
                qw, sc, z = layers[i][shape]
                w4a16_gemm(xs[shape], qw, sc, z, GROUP, split_k=split, config=cfg)
        out[name] = time_graph(layer, LAYERS) * LAYERS / 1e3
        print(f"sequence {name}: {out[name]:.3f} ms a token of linears", flush=True)
    del layers
    torch.cuda.empty_cache()
    return out


def write_table(report: dict) -> str:
    """Keep a --tiles sweep: each shape's fastest (tile, split) in kernels/configs/w4a16_gemv/<GPU>.json
    (read by w4a16_gemm.gemv_launch), beside the default launch's time; other weights keep their entries."""
    from minivllm.kernels.tuned_tables import read_table, table_file
    from minivllm.kernels.w4a16_gemm import GEMV_CONFIG_DIR, GEMV_TILE_KEYS, gemv_key
    path = table_file(GEMV_CONFIG_DIR, report["device"])
    table = read_table(path)
    default = {r["shape"]: (r["config"], r["default_split"]) for r in report["plan"]}
    for shape, best in report["best"].items():
        row = next(r for r in report["plan"] if r["shape"] == shape)
        cfg, split = default[shape]
        now = next((t["graph_us"] for t in report["tiles"] if t["shape"] == shape and t["split_k"] == split
                    and t["tile"] == [cfg[key] for key in GEMV_TILE_KEYS]), None)
        table[gemv_key(row["N"], row["K"], report["group"])] = {
            "label": f"llama-3.1-8b:{shape}", "tile": best["tile"], "split_k": best["split_k"],
            "us": round(best["graph_us"], 2), "default_us": None if now is None else round(now, 2)}
    os.makedirs(GEMV_CONFIG_DIR, exist_ok=True)
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(table.items())) + "\n}\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the plan and the results as JSON")
    ap.add_argument("--dry-run", action="store_true", help="print the shapes and splits; time nothing (no GPU needed)")
    ap.add_argument("--tiles", default=None, help='sweep GEMV tiles: "BN,BK,warps,stages ..." (graph times only)')
    ap.add_argument("--fp16", action="store_true", help="float16 activations and scales (W11-awq's dtype)")
    ap.add_argument("--write-from", metavar="JSON", help="no GPU: keep the best tiles of a --tiles sweep's --out file")
    ap.add_argument("--sequence", default=None, metavar="T,...", help="time whole tokens' GEMVs in sequence per "
                    "table: 'default' (no table), 'kept' (this GPU's), or GEMV table JSON files")
    args = ap.parse_args()
    if args.write_from:
        with open(args.write_from) as f:
            print("wrote", write_table(json.load(f)))
        return
    global DTYPE
    if args.fp16:
        DTYPE = torch.float16
    tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split()] if args.tiles else None
    if tiles and any(len(t) != 4 for t in tiles):
        raise SystemExit('--tiles: each tile is "BLOCK_N,BLOCK_K,num_warps,num_stages"')
    on_gpu = torch.cuda.is_available()
    from minivllm.kernels.device import num_sms as num_sms_of
    num_sms = num_sms_of("cuda:0")  # an H100's 132 without a GPU
    rows = plan(num_sms)
    print(f"device: {torch.cuda.get_device_name(0) if on_gpu else 'none'} ({num_sms} SMs); "
          f"GEMV config {rows[0]['config']}; group {GROUP}; bf16 x [1, K]")
    for r in rows:
        print(f"  {r['shape']:8s} K {r['K']:6d} -> N {r['N']:6d}: int4 {r['int4_bytes'] / 1e6:7.2f} MB "
              f"x {r['copies']:2d} copies, dense bf16 {r['dense_bytes'] / 1e6:7.2f} MB x {r['dense_copies']:2d}; "
              f"default split {r['default_split']}; splits {r['splits']}")
    report = {"device": torch.cuda.get_device_name(0) if on_gpu else None, "num_sms": num_sms, "group": GROUP,
              "runs": RUNS, "graph_calls": GRAPH_CALLS, "plan": rows, "results": []}
    if args.sequence:
        from minivllm.kernels.tuned_tables import read_table, table_file
        from minivllm.kernels.w4a16_gemm import GEMV_CONFIG_DIR, GEMV_TILE_KEYS
        kept = table_file(GEMV_CONFIG_DIR, report["device"] or "NVIDIA H100 80GB HBM3")
        tables = {name: None if name == "default" else read_table(kept if name == "kept" else name)
                  for name in args.sequence.split(",")}
        for name, launch in ((n, table_launches(rows, t)) for n, t in tables.items()):
            print(f"  table {name}: " + "; ".join(f"{s} {','.join(str(c[key]) for key in GEMV_TILE_KEYS)} split {sp}"
                                                 for s, (c, sp) in launch.items()))
        if not args.dry_run:
            if not on_gpu:
                raise SystemExit("no CUDA device: use --dry-run to check the shape logic only")
            torch.manual_seed(0)
            report["sequence_ms"] = time_sequence(rows, tables)
    elif tiles and not args.dry_run:
        if not on_gpu:
            raise SystemExit("no CUDA device: use --dry-run to check the shape logic only")
        torch.manual_seed(0)
        report["tiles"] = sweep_tiles(rows, tiles)
        best = {}
        for res in report["tiles"]:
            if res["shape"] not in best or res["graph_us"] < best[res["shape"]]["graph_us"]:
                best[res["shape"]] = res
        report["best"] = best
        print("\nbest per shape: " + "; ".join(f"{s} {b['tile']} split {b['split_k']} {b['graph_us']:.1f} us"
                                               for s, b in best.items())
              + f"\nlinears of one batch-1 token with these: {sum(b['graph_us'] for b in best.values()) * 32 / 1e3:.2f} ms")
    elif not args.dry_run:
        if not on_gpu:
            raise SystemExit("no CUDA device: use --dry-run to check the shape logic only")
        torch.manual_seed(0)
        print(f"\n{'shape':8s} {'variant':22s} {'eager us':>9s} {'graph us':>9s} {'int4 GB/s':>10s}")
        for r in rows:
            for res in bench_shape(r):
                report["results"].append(res)
                extra = f"  (bf16 weight: {res['dense_GBps']:.0f} GB/s)" if "dense_GBps" in res else ""
                print(f"{res['shape']:8s} {res['variant']:22s} {res['eager_us']:9.1f} {res['graph_us']:9.1f} "
                      f"{res['int4_GBps']:10.0f}{extra}", flush=True)
        per_token = {}
        for res in report["results"]:
            per_token.setdefault(res["variant"].split(" (")[0], 0.0)
            per_token[res["variant"].split(" (")[0]] += res["graph_us"] * 32  # 32 layers, one of each linear
        report["per_token_linears_us"] = per_token
        print("\nlinears of one batch-1 token (32 layers, graph times): "
              + ", ".join(f"{v} {t / 1e3:.2f} ms" for v, t in per_token.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
