"""Sweep the fused MoE kernels' tiles on this GPU; write the best per token count to the JSON that
minivllm loads at run time (kernels/fused_moe_config.py):

    python3 scripts/sweep_fused_moe.py                        # Qwen3-30B-A3B's shape, bf16
    python3 scripts/sweep_fused_moe.py --model-config mixtral-dir --tokens 1,64,4096 --out $OUT/x.json

For each token count M (a random router's routing of M random tokens) and each block size
BLOCK_M the tokens are aligned to, every candidate tile of the up GEMM (gate/up, SiLU-and-mul
fused) and of the down GEMM is timed alone (triton.testing.do_bench, cold L2: a layer's weights
are not in cache when its MoE runs); the entry kept is the BLOCK_M whose alignment + best up +
best down is fastest. The chosen config is checked against the reference before it is kept.

The file is written after every M, and token counts already in it are skipped (--redo to redo
them), so a sweep longer than one device command continues where the last one stopped
(--budget-s). Default output: minivllm/kernels/configs/fused_moe/<GPU name>.json; commit it.
Candidate kernels compile once each (about 250, a few minutes on the first call; Triton caches
them on disk for later calls on the same machine). --decode-gemv sweeps the one-token path's two
GEMV kernels instead (M = 1 runs them, not the grouped GEMMs) and keeps the best as the M = 1
entry's "gemv" tiles.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch

from minivllm.bench.model_dirs import load_config
from minivllm.kernels import fused_moe as fm
from minivllm.kernels.fused_moe_config import config_file, default_config, shape_key
from minivllm.kernels.moe_align import moe_align

DEFAULT_TOKENS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096, 8192, 16384]
SMEM_LIMIT = 200 * 1024  # bytes of shared memory a candidate may use (H100: 227 KB a block)


def moe_shape(cfg: dict) -> tuple[int, int, int, int]:
    """(experts, expert width I, hidden H, top_k) of a HF MoE config."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    return experts, cfg.get("moe_intermediate_size") or cfg["intermediate_size"], cfg["hidden_size"], \
        cfg["num_experts_per_tok"]


def block_sizes(m: int, experts: int, top_k: int) -> list[int]:
    rows = m * top_k / experts  # mean rows per expert
    if rows <= 4:
        return [16]
    if rows <= 32:
        return [16, 32]
    if rows <= 128:
        return [32, 64]
    return [64, 128]


def tiles(block_m: int, rows_per_expert: float, up: bool) -> list[dict]:
    bns = [16, 32, 64, 128] if block_m == 16 else [32, 64, 128]
    bks = [64, 128, 256] if block_m == 16 else [64, 128]
    out = []
    for bn, bk, warps, stages in itertools.product(bns, bks, (4, 8), (3, 4)):
        smem = stages * 2 * (block_m * bk + (2 if up else 1) * bk * bn)
        if smem <= SMEM_LIMIT:
            out.append({"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1 if rows_per_expert <= 16 else 8,
                        "num_warps": warps, "num_stages": stages})
    return out


def make_case(m: int, experts: int, inter: int, hidden: int, top_k: int, weights: tuple, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to("cuda", torch.bfloat16)
    logits = torch.randn(m, experts, generator=g).to("cuda")
    topk_w, topk_ids = fm.topk_softmax_reference(logits, top_k, renormalize=True)
    return x, *weights, topk_w, topk_ids


def time_gemm(bench, case, block_m: int, tile: dict, up: bool, hmid: torch.Tensor) -> float:
    """Milliseconds of one GEMM of the layer (up: x -> hmid; down: hmid -> [M k, H]) with `tile`."""
    x, w13, w2, topk_w, topk_ids = case
    m, k = topk_ids.shape
    sorted_ids, block_expert, num_padded = moe_align(topk_ids, w13.shape[0], block_m)
    weights = topk_w.reshape(-1).contiguous()
    inter, hidden = w2.shape[2], w2.shape[1]
    if up:
        a, w, out, n, kdim = x, w13, hmid, inter, hidden
    else:
        a, w, out, n, kdim = hmid, w2, torch.empty(m * k, hidden, device="cuda", dtype=x.dtype), hidden, inter

    def run():
        fm._grouped_gemm(a, w, out, weights, sorted_ids, block_expert, num_padded, block_expert.shape[0], m * k, n,
                         kdim, a_row_div=k if up else 1, silu_mul=up, mul_weight=not up, block_m=block_m, tile=tile)
    try:
        return bench(run)
    except Exception as e:  # noqa: BLE001 - out of resources on this GPU: not a candidate
        print(f"  skip {tile}: {type(e).__name__}", flush=True)
        return float("inf")


def sweep_one(bench, case, block_m: int) -> dict:
    x, w13, w2, _, topk_ids = case
    m, k = topk_ids.shape
    rows = m * k / w13.shape[0]
    hmid = torch.randn(m * k, w2.shape[2], device="cuda").to(x.dtype)
    align_ms = bench(lambda: moe_align(topk_ids, w13.shape[0], block_m))
    best = {}
    for up in (True, False):
        timed = [(time_gemm(bench, case, block_m, t, up, hmid), t) for t in tiles(block_m, rows, up)]
        ms, tile = min(timed, key=lambda p: p[0])
        best["up" if up else "down"] = (ms, tile)
    total = align_ms + best["up"][0] + best["down"][0]
    return {"BLOCK_M": block_m, "up": best["up"][1], "down": best["down"][1],
            "us": {"align": round(align_ms * 1e3, 2), "up": round(best["up"][0] * 1e3, 2),
                   "down": round(best["down"][0] * 1e3, 2), "total": round(total * 1e3, 2)}}


GEMV_CANDIDATES = {
    # (BLOCK_K up to the whole row: one K step issues every load of the program at once; lease 12
    # chose up 4 x 512 / 8 warps and down 16 x 128 / 4 warps from the smaller set, at 2.0-2.2 TB/s)
    "up": [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w} for n in (2, 4, 8, 16) for k in (256, 512, 1024, 2048)
           for w in (4, 8)],
    "down": [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w} for n in (4, 8, 16, 32) for k in (128, 256, 512, 1024)
             for w in (2, 4, 8)],
}


def sweep_decode_gemv(bench, case, grouped_config: dict) -> dict:
    """M = 1: the one-token GEMV path's tiles, each part's candidates timed with the other part
    at its default, then the pair together against the grouped path (align + GEMMs + sum)."""
    x, w13, w2, topk_w, topk_ids = case

    def one_token(tiles):
        return lambda: fm._fused_moe_one_token(x, w13, w2, topk_w, topk_ids, None, None, tiles)
    best = {}
    for part, candidates in GEMV_CANDIDATES.items():
        timed = [(bench(one_token(dict(fm.DECODE_GEMV_TILES, **{part: t}))), t) for t in candidates]
        best[part] = min(timed, key=lambda p: p[0])[1]
    fm.DECODE_GEMV = False
    try:
        grouped_ms = bench(lambda: fm.fused_moe_triton(x, w13, w2, topk_w, topk_ids, config=grouped_config))
    finally:
        fm.DECODE_GEMV = True
    return {"gemv": best, "us": {"gemv": round(bench(one_token(best)) * 1e3, 2),
                                 "gemv_default": round(bench(one_token(fm.DECODE_GEMV_TILES)) * 1e3, 2),
                                 "grouped": round(grouped_ms * 1e3, 2)}}


def check(case, config: dict) -> float:
    x, w13, w2, topk_w, topk_ids = case
    out = fm.fused_moe_triton(x, w13, w2, topk_w, topk_ids, config=config).float()
    ref = fm.fused_moe_reference(x.float(), w13.float(), w2.float(), topk_w, topk_ids)
    return ((out - ref).norm() / ref.norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", default="qwen3-30b-a3b", help="bundled name or a directory with config.json")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    p.add_argument("--out", default=None, help="default: the run-time file for this GPU")
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--rep-ms", type=int, default=20, help="do_bench's timing window per candidate")
    p.add_argument("--redo", action="store_true", help="re-sweep token counts already in the file")
    p.add_argument("--decode-gemv", action="store_true",
                   help="sweep the one-token GEMV path's tiles instead (kept as the M = 1 entry's \"gemv\")")
    args = p.parse_args()
    import triton.testing
    t0 = time.perf_counter()
    experts, inter, hidden, top_k = moe_shape(load_config(args.model_config))
    device = torch.cuda.get_device_name()
    out_path = args.out or config_file(device)
    table = json.load(open(out_path)) if os.path.isfile(out_path) else {}
    key = shape_key(experts, inter, hidden, "bfloat16")
    entries = table.setdefault(key, {})
    bench = lambda fn: float(triton.testing.do_bench(fn, warmup=5, rep=args.rep_ms, return_mode="median"))  # noqa: E731
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g).div_(hidden ** 0.5).bfloat16(),
               torch.randn(experts, hidden, inter, device="cuda", generator=g).div_(inter ** 0.5).bfloat16())
    print(f"{device}: {key}, top_k {top_k} -> {out_path}", flush=True)
    if args.decode_gemv:
        case = make_case(1, experts, inter, hidden, top_k, weights, seed=1)
        entry = entries.setdefault("1", default_config(1, experts, top_k))
        found = sweep_decode_gemv(bench, case, entry)
        entry["gemv"] = found["gemv"]
        err = check(case, entry)
        assert err < 2e-2, f"M=1: the chosen GEMV tiles are off the reference ({err:.3g}): {found}"
        print(json.dumps({"M": 1, **found, "rel_err": round(err, 5)}), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        return
    for m in (int(t) for t in args.tokens.split(",")):
        if str(m) in entries and not args.redo:
            continue
        if time.perf_counter() - t0 > args.budget_s:
            print(f"budget spent: stopped before M={m}; run again to continue", flush=True)
            break
        case = make_case(m, experts, inter, hidden, top_k, weights, seed=m)
        found = [sweep_one(bench, case, bm) for bm in block_sizes(m, experts, top_k)]
        best = min(found, key=lambda r: r["us"]["total"])
        err = check(case, best)
        assert err < 2e-2, f"M={m}: the chosen config is off the reference ({err:.3g}): {best}"
        entries[str(m)] = best
        print(json.dumps({"M": m, **best, "rel_err": round(err, 5)}), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
