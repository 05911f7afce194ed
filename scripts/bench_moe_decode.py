"""Batch-1 MoE decode GEMVs on Qwen3-30B-A3B's expert shapes (issue 21): the one-token kernels
of kernels/fused_moe.py, the streaming variant at several tiles, and a plain read of the same
expert bytes (the ceiling), each timed inside a CUDA graph of 32 calls whose expert ids cycle
over 16 random draws from 128 experts (so the weights come from HBM, as in a real step), with
PDL as the engine launches them.

    python3 scripts/bench_moe_decode.py --out moe-decode.json

Prints and writes us per call and the read rate (bytes of the 8 selected experts / time)."""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

import minivllm.kernels.fused_moe as fm
from minivllm.bench.gpu_timing import time_graph


@triton.jit
def _read_kernel(w_ptr, ids_ptr, out_ptr, stride_we, PER_EXPERT, BLOCK: tl.constexpr):
    """Program (j, c): the sum of elements c * BLOCK .. of expert ids[j] (a plain streaming read)."""
    j, c = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + j).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(w_ptr + e * stride_we + offs, mask=offs < PER_EXPERT, other=0.0)
    tl.store(out_ptr + j * tl.num_programs(1) + c, tl.sum(w.to(tl.float32), axis=0))


def read(w, ids, out, block=8192, warps=4):
    per = w[0].numel()
    _read_kernel[(ids.numel(), triton.cdiv(per, block))](w, ids, out, w.stride(0), per, BLOCK=block, num_warps=warps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    e, k, h, i = args.experts, args.top_k, args.hidden, args.inter
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.02).to(dev, dt)
    w2 = (torch.randn(e, h, i, generator=g) * 0.02).to(dev, dt)
    x = torch.randn(1, h, generator=g).to(dev, dt)
    draws = 16
    id_sets = [torch.randperm(e, generator=g)[:k].to(torch.int32).view(1, k).to(dev) for _ in range(draws)]
    w_sets = [torch.softmax(torch.randn(1, k, generator=g), -1).to(dev) for _ in range(draws)]
    up_bytes, down_bytes = k * 2 * i * h * 2, k * h * i * 2
    ref = fm.fused_moe_reference(x.float(), w13.float(), w2.float(), w_sets[0], id_sets[0])

    def rel_err(out):
        return ((out.float() - ref).norm() / ref.norm()).item()

    rows = []

    def record(name, us, nbytes, err=None, **extra):
        row = {"variant": name, "us": round(us, 2), "TB_s": round(nbytes / us / 1e6, 3), **extra}
        if err is not None:
            row["rel_err"] = err
        rows.append(row)
        print(json.dumps(row), flush=True)

    part = torch.empty(k, 1024, device=dev)
    record("read up bytes", time_graph(lambda n: read(w13, id_sets[n], part), draws), up_bytes)
    record("read down bytes", time_graph(lambda n: read(w2, id_sets[n], part), draws), down_bytes)

    tiles = fm.pick_config(torch.cuda.get_device_name(), 1, e, i, h, k, "bfloat16").get("gemv", fm.DECODE_GEMV_TILES)
    gemv = lambda n: fm._fused_moe_one_token(x, w13, w2, w_sets[n], id_sets[n], None, None, tiles)  # noqa: E731
    record("gemv up+down (engine today)", time_graph(gemv, draws), up_bytes + down_bytes,
           rel_err(fm._fused_moe_one_token(x, w13, w2, w_sets[0], id_sets[0], None, None, tiles)), tiles=tiles)

    def stream(t):
        return lambda n: fm._fused_moe_one_token_stream(x, w13, w2, w_sets[n], id_sets[n], None, None, t)
    base = fm.STREAM_TILES
    record("stream up+down (default tiles)", time_graph(stream(base), draws), up_bytes + down_bytes,
           rel_err(stream(base)(0)), tiles=base)
    # one part's tiles swept with the other part at its default (as sweep_fused_moe.py does): the
    # pair is what a step runs, and PDL overlaps the two
    best = {}
    for part, grid in (("up", itertools.product((1, 2, 4), (4, 8), (2, 4, 8))),
                       ("down", itertools.product((2, 4, 8, 16), (2, 4, 8), (2, 4, 8)))):
        timed = []
        for bn, warps, pps in grid:
            t = dict(base, **{part: {"BLOCK_N": bn, "num_warps": warps, "programs_per_sm": pps}})
            try:
                us = time_graph(stream(t), draws)
            except Exception as ex:  # a tile that does not compile (registers): skipped, reported
                print(f"skip {part} {bn} {warps} {pps}: {type(ex).__name__}", flush=True)
                continue
            timed.append((us, t[part]))
            record(f"stream sweep {part}", us, up_bytes + down_bytes, tiles=t[part])
        best[part] = min(timed, key=lambda p: p[0])[1]
    record("stream up+down (best of sweep)", time_graph(stream(best), draws), up_bytes + down_bytes,
           rel_err(stream(best)(0)), tiles=best)
    record("gemv up+down again", time_graph(gemv, draws), up_bytes + down_bytes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": vars(args), "rows": rows, "best_stream": best},
                      f, indent=1)


if __name__ == "__main__":
    main()
