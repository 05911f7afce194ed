"""Development probe: decode-attention bandwidth on W3-like batches (Qwen3-8B heads; each context
is a prompt U[100, 1024] plus part of an output U[100, 1024]) against the split count, the order
of the sequences in the grid (as scheduled vs longest first) and the tile configuration; plus
the prefill kernel on the same decode rows (what a mixed step runs today) and a plain device
copy of the same number of bytes (the reachable bandwidth).

    python3 scripts/sweep_decode_attention.py [--batches 32 110 256 512]
"""

import argparse
import itertools
import json
import random

import torch

from minivllm.bench.kernel_bench import build_paged, timer
from minivllm.kernels import decode_attention as da
from minivllm.kernels.prefill_attention import prefill_attention
from minivllm.server.bench_serve import running_context_lengths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 110, 256, 512])
    ap.add_argument("--configs-at", type=int, nargs="*", default=[110], help="batches for the tile-configuration sweep")
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--orders", nargs="+", default=["scheduled", "longest_first"])
    ap.add_argument("--cudagraph", action="store_true",
                    help="time CUDA-graph replays (as served): without it, small batches measure Triton's host launch cost")
    args = ap.parse_args()
    heads, kv_heads, d = 32, 8, 128
    bench = timer(False)
    if args.cudagraph:
        import triton.testing

        def bench(fn):
            fn()  # compile outside the capture
            return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    original = da.decode_config
    for b in args.batches:
        lens = running_context_lengths(b, random.Random(b))
        kv_bytes = 2 * sum(lens) * kv_heads * d * 2
        src = torch.empty(kv_bytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_gbs = round(2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e6)  # read + write
        del src, dst
        for order in args.orders:
            ordered = sorted(lens, reverse=True) if order == "longest_first" else lens
            paged = build_paged(ordered, kv_heads, d, torch.bfloat16, "cuda")
            q = torch.randn(b, heads, d, device="cuda").to(torch.bfloat16)
            qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda")
            out = torch.empty_like(q)

            def run(s, ws):
                return da.decode_attention(q, paged.k_cache, paged.v_cache, qsl, paged.seq_lens, paged.block_tables,
                                           d**-0.5, num_splits=s, workspace=ws, out=out)

            row = {"batch": b, "order": order, "copy_GBs": copy_gbs, "mean_ctx": round(sum(lens) / b)}
            for s in (1, 2, 4, 8):
                ws = da.DecodeWorkspace.allocate(b, heads, d, s, q.device) if s > 1 else None
                row[f"s{s}"] = round(kv_bytes / bench(lambda: run(s, ws)) / 1e6)  # GB/s of K/V read
            row["prefill_kernel"] = round(kv_bytes / bench(lambda: prefill_attention(
                q, paged.k_cache, paged.v_cache, qsl, paged.seq_lens, paged.block_tables, d**-0.5,
                max_query_len=64, out=out)) / 1e6)
            print(json.dumps(row), flush=True)
            if b not in args.configs_at:
                continue
            for block_n, warps, stages in itertools.product(args.block_n, args.warps, args.stages):
                da.decode_config = lambda *a, **k: {"BLOCK_N": block_n, "num_warps": warps,  # noqa: E731
                                                     "num_stages": stages}
                cfg = {"batch": b, "order": order, "BLOCK_N": block_n, "warps": warps, "stages": stages}
                for s in (1, 2, 4):
                    ws = da.DecodeWorkspace.allocate(b, heads, d, s, q.device) if s > 1 else None
                    try:
                        cfg[f"s{s}"] = round(kv_bytes / bench(lambda: run(s, ws)) / 1e6)
                    except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                        cfg[f"s{s}"] = type(e).__name__
                print(json.dumps(cfg), flush=True)
            da.decode_config = original


if __name__ == "__main__":
    main()
