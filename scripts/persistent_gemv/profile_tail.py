"""Times the W4 layer tail (minivllm/kernels/cuda/w4_layer_tail.cu) alone and says where its time goes.

A token's 32 tail launches of Llama-3.1-8B shapes (4 stages each: o, gate_up, down and the next
layer's qkv; random tiles, distinct per layer so the weights stream from HBM), captured in one CUDA
graph with nothing between them (no attention): the median ms a token (bench/gpu_timing.py's
time_graph) against the tile bytes' time at the median copy rate (bench/common.py's
measure_copy_bandwidth; until 2026-11-29 both were the best of their runs). Then one replay of the
token from the profiling build (-DW4LT_PROFILE, without PDL): each block's globaltimer
stamps per stage (waiting for the previous stage, loading the input, the tiles) and the launches'
overlap. One JSON line per figure on stdout.

    python3 scripts/persistent_gemv/profile_tail.py [--defines W4LT_SLOTS=3 ...] [--no-pdl]

(gpu_multi.sh step tail-profile; needs nvcc, CUDA_HOME if it is not on PATH.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from minivllm.bench.common import measure_copy_bandwidth  # noqa: E402
from minivllm.bench.gpu_timing import time_graph  # noqa: E402
from minivllm.kernels import w4_layer_tail as lt  # noqa: E402
from minivllm.quant.w4_tiles import TILE_WORDS  # noqa: E402

H, I, Q, KV = 4096, 14336, 4096, 1024
STAMPS = 2 + 4 * lt.MAX_STAGES


def random_tiles(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random weights in the tile format: random words; every (row, group) {scale 2^-10, 1024 + 8}."""
    n = (rows // 16) * (k // 2048)
    t = torch.randint(-2**31, 2**31 - 1, (n, TILE_WORDS), dtype=torch.int64, device="cuda", generator=gen)
    t = t.to(torch.int32)
    sz = 0x1400 | (0x6408 << 16)  # half2 {2^-10, 1032}
    t[:, TILE_WORDS - 256:] = sz  # < 2^31
    return t.reshape(-1)


def build_token(layers: int, lib, grid: int, counters: torch.Tensor):
    """The launches of one token's tails: a list of stage lists, the buffers kept alive."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    keep = []
    norm_w = torch.ones(H, dtype=torch.float16, device="cuda")
    attn = torch.randn(1, Q, device="cuda").half()
    residual = torch.randn(1, H, device="cuda").half()
    qkv_tiles = [random_tiles(Q + 2 * KV, H, gen) for _ in range(layers)]
    launches = []
    for layer in range(layers):
        o_t, gu_t, dn_t = random_tiles(H, Q, gen), random_tiles(2 * I, H, gen), random_tiles(H, I, gen)
        o, act, out, res1, res2 = (torch.empty(n, dtype=torch.float16, device="cuda") for n in (H, I, H, H, H))
        qkv = torch.empty(Q + 2 * KV, dtype=torch.float16, device="cuda")
        stages = [lt.stage(o_t, attn, o, Q, H),
                  lt.stage(gu_t, o, act, H, 2 * I, lt.IN_ADD_NORM, lt.OUT_SWIGLU, residual, norm_w, res1),
                  lt.stage(dn_t, act, out, I, H),
                  lt.stage(qkv_tiles[(layer + 1) % layers], out, qkv, H, Q + 2 * KV, lt.IN_ADD_NORM, lt.OUT_STORE,
                           res1, norm_w, res2)]
        keep += [o_t, gu_t, dn_t, o, act, out, res1, res2, qkv]
        launches.append(stages)
    keep += qkv_tiles + [norm_w, attn, residual]
    tile_bytes = sum(t.numel() * 4 for t in keep if t.dtype == torch.int32)
    return launches, keep, tile_bytes


def token(launches, lib, grid, counters):
    """The token's launches as a function of the layer (gpu_timing.time_graph's fn)."""
    kmax, dev = max(H, I, Q), torch.device("cuda")
    return lambda layer: lt.launch(launches[layer], counters, 1e-5, grid, kmax, dev, lib)


def profile(launches, grid: int, counters, defines) -> dict:
    lib = lt.load_library(("W4LT_PROFILE", *defines))
    assert lib.w4lt_grid(torch.cuda.current_device(), max(H, I, Q)) == grid  # (also sets its shared-memory limit)
    n = len(launches)
    assert n <= 64, "the profiling build keeps 64 launches' stamps"
    buf = torch.zeros(64 * grid * STAMPS, dtype=torch.int64, device="cuda")
    import ctypes
    lib.w4lt_set_profile.argtypes = [ctypes.c_void_p]
    # without PDL: a launch's blocks may otherwise start before the previous launch counts itself out
    # (g_launch), and their stamps would land in its slots
    pdl = os.environ.get("MINIVLLM_W4_TAIL_PDL")
    os.environ["MINIVLLM_W4_TAIL_PDL"] = "0"
    try:
        run = token(launches, lib, grid, counters)
        for layer in range(n):  # warm, then one replay of the token's graph with the stamps on
            run(layer)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for layer in range(n):
                run(layer)
        assert lib.w4lt_set_profile(buf.data_ptr()) == 0  # (restarts the launch count: launch i, slot i)
        graph.replay()
        torch.cuda.synchronize()
    finally:
        if pdl is None:
            os.environ.pop("MINIVLLM_W4_TAIL_PDL")
        else:
            os.environ["MINIVLLM_W4_TAIL_PDL"] = pdl
    p = buf.view(64, grid, STAMPS)[:n].cpu().double()
    stages = {}
    for s in range(lt.MAX_STAGES):
        begin, waited, loaded, end = (p[:, :, 2 + 4 * s + j] for j in range(4))
        has = begin > 0
        stages[s] = {key: round(float(v[has].mean()) / 1e3, 2) for key, v in
                     (("wait_us", waited - begin), ("input_us", loaded - waited), ("tiles_us", end - loaded))}
        first = begin.masked_fill(~has, float("inf")).amin(1)
        stages[s]["span_us"] = round(float((end.amax(1) - first).mean()) / 1e3, 2)
        stages[s]["slowest_tiles_us"] = round(float((end - loaded).masked_fill(~has, 0).amax(1).mean()) / 1e3, 2)
    entry, exit_ = p[:, :, 0], p[:, :, 1]
    span = (exit_.amax(1) - entry.amin(1)) / 1e3
    gaps = (entry[1:].amin(1) - exit_[:-1].amax(1)) / 1e3  # next launch's first entry - this one's last exit
    return {"stages": stages, "launch_us": round(float(span.mean()), 2),
            "entry_spread_us": round(float(((entry.amax(1) - entry.amin(1)) / 1e3).mean()), 2),
            "gap_us": round(float(gaps.mean()), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20, help="graph replays timed (the median is kept)")
    ap.add_argument("--defines", nargs="*", default=[])
    ap.add_argument("--no-pdl", action="store_true")
    args = ap.parse_args()
    if args.no_pdl:
        os.environ["MINIVLLM_W4_TAIL_PDL"] = "0"
    defines = tuple(args.defines)
    lib = lt.load_library(defines)
    grid = lib.w4lt_grid(torch.cuda.current_device(), max(H, I, Q))
    counters = torch.zeros(lt.MAX_STAGES + 1, dtype=torch.int32, device="cuda")
    launches, keep, tile_bytes = build_token(args.layers, lib, grid, counters)
    rate = measure_copy_bandwidth()["bandwidth_TBps"]
    us = time_graph(token(launches, lib, grid, counters), copies=args.layers, runs=args.iters, calls=args.layers)
    ms = us * args.layers / 1e3
    bound = tile_bytes / rate / 1e9
    print(json.dumps({"figure": "tails", "defines": list(defines), "pdl": not args.no_pdl, "grid": grid,
                      "coop": lt.coop_on(),
                      "ms_per_token": round(ms, 4), "us_per_launch": round(us, 2),
                      "tile_GB": round(tile_bytes / 1e9, 3), "copy_TBps": round(rate, 3),
                      "copy_bound_ms": round(bound, 4), "share_of_copy_bound": round(bound / ms, 3)}), flush=True)
    print(json.dumps({"figure": "tail-profile", "defines": list(defines), "pdl": False,
                      **profile(launches, grid, counters, defines)}), flush=True)


if __name__ == "__main__":
    main()
