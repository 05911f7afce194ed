"""Development probe: decode-attention bandwidth against the split count, for serving-like
batches (Qwen3-8B heads, contexts drawn U[lo, hi] per sequence, not all equal), to check the
split rule (choose_num_splits) where the W3 batches live (32..1024 sequences).

    python3 scripts/sweep_decode_splits.py [--ctx 100 1600]
"""

import argparse
import json
import random

import torch

from minivllm.bench.kernel_bench import build_paged, timer
from minivllm.kernels.decode_attention import DecodeWorkspace, choose_num_splits, decode_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, nargs=2, default=[100, 1600])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    args = ap.parse_args()
    heads, kv_heads, d = 32, 8, 128
    bench = timer(False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for b in args.batches:
        rng = random.Random(b)
        lens = [rng.randint(*args.ctx) for _ in range(b)]
        paged = build_paged(lens, kv_heads, d, torch.bfloat16, "cuda")
        q = torch.randn(b, heads, d, device="cuda").to(torch.bfloat16)
        qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        kv_bytes = 2 * sum(lens) * kv_heads * d * 2
        row = {"batch": b, "rule": choose_num_splits(b, kv_heads, 4096, sms)}
        for s in (1, 2, 4, 8, 16):
            ws = DecodeWorkspace.allocate(b, heads, d, s, q.device) if s > 1 else None
            ms = bench(lambda: decode_attention(q, paged.k_cache, paged.v_cache, qsl, paged.seq_lens,
                                                paged.block_tables, d**-0.5, num_splits=s, workspace=ws, out=out))
            row[f"s{s}"] = round(kv_bytes / ms / 1e6)  # GB/s
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
