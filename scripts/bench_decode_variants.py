"""Issue 25 probe: decode attention's variants on W11-fp8-like batches (Qwen3-8B heads: 32 query,
8 kv heads, head_dim 128), bf16 and FP8 caches, timed with triton.testing.do_bench (L2 flushed).

    python3 scripts/bench_decode_variants.py [--batches 64 256] [--ctx 288 2048] [--out F]

Variants: for FP8, K/V widened to float16 (the default) or to the query's dtype
(MINIVLLM_FP8_KV_WIDEN=query, the layout before lease 17). Each row gives the K/V bytes read
per second and the output's largest relative error against the bf16 cache. (Lease 17 also
timed a transposed product layout, K/V as the left operand of the dots: slower in every case,
so it was dropped.)
"""

import argparse
import json

import torch

from minivllm.bench.kernel_bench import build_paged, max_rel_err, timer
from minivllm.kernels import decode_attention as da
from minivllm.kernels import store_kv
from minivllm.quant.fp8 import FP8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--ctx", type=int, nargs="+", default=[288, 2048])
    ap.add_argument("--out")
    args = ap.parse_args()
    heads, kv_heads, d = 32, 8, 128
    bench = timer(False)
    rows = []
    for batch in args.batches:
        for ctx in args.ctx:
            paged = build_paged([ctx] * batch, kv_heads, d, torch.bfloat16, "cuda")
            k8, v8 = paged.k_cache.to(FP8), paged.v_cache.to(FP8)
            one = torch.ones(1, device="cuda")
            q = torch.randn(batch, heads, d, device="cuda").to(torch.bfloat16)
            qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
            splits = da.choose_num_splits(batch, kv_heads, ctx)
            ws = da.DecodeWorkspace.allocate(batch, heads, d, splits, "cuda")
            ref = None
            for cache, widen_f16 in (("bf16", None), ("fp8", True), ("fp8", False)):
                kc, vc, scales = (paged.k_cache, paged.v_cache, {}) if cache == "bf16" else (
                    k8, v8, {"k_scale": one, "v_scale": one})
                store_kv.FP8_WIDEN_F16 = bool(widen_f16)
                out = torch.empty_like(q)
                run = lambda: da.decode_attention(q, kc, vc, qsl, paged.seq_lens, paged.block_tables,  # noqa: E731
                                                  d**-0.5, num_splits=splits, workspace=ws, out=out, **scales)
                ms = bench(run)
                if ref is None:
                    ref = out.clone()
                kv_bytes = 2 * batch * ctx * kv_heads * d * kc.element_size()
                rows.append({"batch": batch, "ctx": ctx, "splits": splits, "cache": cache,
                             "widen": None if cache == "bf16" else ("fp16" if widen_f16 else "query"),
                             "ms": round(ms, 4), "GB/s": round(kv_bytes / ms / 1e6, 1),
                             "max_rel_err": round(max_rel_err(out, ref), 5)})
                print(json.dumps(rows[-1]), flush=True)
    store_kv.FP8_WIDEN_F16 = True
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
