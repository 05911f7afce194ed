"""Microbenchmark of the Triton attention kernels, with SDPA on contiguous K/V as a sanity peer.

    python -m minivllm.bench.kernel_bench                 # on a CUDA GPU, prints JSON lines
    python -m minivllm.bench.kernel_bench --models llama-8b --skip-peer
    TRITON_INTERPRET=1 python -m minivllm.bench.kernel_bench --smoke   # CPU plumbing check only

Decode: batch x context from DECODE_CASES, one new token per sequence; reports the achieved
bandwidth = K/V bytes read / time. Prefill: a W1-like batch of fresh prompts of 100-1024
tokens; reports causal attention TFLOP/s (4 * heads * head_dim * visible (q, k) pairs / time).
Times are medians of triton.testing.do_bench (which flushes L2 between runs). The peer is
torch's scaled_dot_product_attention on the same K/V laid out contiguously (no paging), so it
is the bar to reach, not an equal; `max_rel_err` compares the two outputs.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MODELS = {  # name -> (num_heads, num_kv_heads, head_dim)
    "qwen3-0.6b": (16, 8, 128),
    "llama-8b": (32, 8, 128),
}
DECODE_CASES = [(1, 4096), (1, 32768), (256, 512), (256, 2048)]  # (batch, context length)
PREFILL_PROMPTS = 16
PREFILL_LEN_RANGE = (100, 1024)
BLOCK_SIZE = 16


@dataclass
class Paged:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    seq_lens_list: list[int]

    def contiguous_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's K and V as [1, num_kv_heads, seq_len, head_dim] (for the peer)."""
        from minivllm.attention.reference import gather_kv

        n = self.seq_lens_list[i]
        k = gather_kv(self.k_cache, self.block_tables[i], n).transpose(0, 1).unsqueeze(0)
        v = gather_kv(self.v_cache, self.block_tables[i], n).transpose(0, 1).unsqueeze(0)
        return k.contiguous(), v.contiguous()


def build_paged(seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: str, seed: int = 0) -> Paged:
    """Random K/V for every token, in shuffled (non-contiguous) cache blocks."""
    per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(per_seq)
    gen = torch.Generator(device=device).manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).to(torch.int32).to(device)
    table = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return Paged(k, v, table, lens, list(seq_lens))


def timer(smoke: bool) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn()."""
    if smoke:
        def cpu_time(fn: Callable[[], object]) -> float:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return cpu_time
    import triton.testing

    return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """q: [B, H, Lq, D]; k, v: [B, Hkv, Lk, D]; grouped-query via enable_gqa (torch >= 2.5)."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    except (TypeError, RuntimeError):  # no enable_gqa: expand K/V (reads group x more bytes)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float().flatten(0, -2), ref.float().flatten(0, -2)
    return ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).max().item()


def bench_decode(model: str, batch: int, ctx: int, args: argparse.Namespace, bench: Callable) -> dict:
    from minivllm.kernels.decode_attention import choose_num_splits, decode_attention

    num_heads, num_kv_heads, head_dim = MODELS[model]
    dtype, device = args.dtype, args.device
    paged = build_paged([ctx] * batch, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(batch, num_heads, head_dim, device=device).to(dtype)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    run = lambda: decode_attention(q, paged.k_cache, paged.v_cache, qsl, paged.seq_lens,  # noqa: E731
                                   paged.block_tables, scale, max_seq_len=ctx, out=out)
    ms = bench(run)
    kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim * paged.k_cache.element_size()
    res = {"kernel": "decode", "model": model, "batch": batch, "ctx": ctx, "dtype": str(dtype).split(".")[-1],
           "num_splits": choose_num_splits(batch, num_kv_heads, ctx, args.num_sms),
           "ms": round(ms, 4), "GB/s": round(kv_bytes / ms / 1e6, 1)}
    if not args.skip_peer:
        res.update(_decode_peer(q, paged, out, scale, kv_bytes, bench))
    return res


def _decode_peer(q, paged: Paged, out, scale, kv_bytes, bench) -> dict:
    batch = q.shape[0]
    ks, vs = zip(*(paged.contiguous_kv(i) for i in range(batch)))
    k, v = torch.cat(ks), torch.cat(vs)  # [B, Hkv, ctx, D]
    del ks, vs
    q4 = q.unsqueeze(2)  # [B, H, 1, D]
    peer = lambda: sdpa(q4, k, v, causal=False, scale=scale)  # noqa: E731
    ref = peer().squeeze(2)
    ms = bench(peer)
    return {"peer_ms": round(ms, 4), "peer_GB/s": round(kv_bytes / ms / 1e6, 1), "max_rel_err": max_rel_err(out, ref)}


def prefill_lens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(*PREFILL_LEN_RANGE) for _ in range(n)]


def bench_prefill(model: str, lens: list[int], args: argparse.Namespace, bench: Callable) -> dict:
    from minivllm.kernels.prefill_attention import prefill_attention

    num_heads, num_kv_heads, head_dim = MODELS[model]
    dtype, device = args.dtype, args.device
    paged = build_paged(lens, num_kv_heads, head_dim, dtype, device)
    total = sum(lens)
    q = torch.randn(total, num_heads, head_dim, device=device).to(dtype)
    qsl_list = [0]
    for n in lens:
        qsl_list.append(qsl_list[-1] + n)
    qsl = torch.tensor(qsl_list, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    run = lambda: prefill_attention(q, paged.k_cache, paged.v_cache, qsl, paged.seq_lens,  # noqa: E731
                                    paged.block_tables, scale, max_query_len=max(lens), out=out)
    ms = bench(run)
    flops = 4 * num_heads * head_dim * sum(n * (n + 1) // 2 for n in lens)
    res = {"kernel": "prefill", "model": model, "num_prompts": len(lens), "tokens": total,
           "max_len": max(lens), "dtype": str(dtype).split(".")[-1],
           "ms": round(ms, 4), "TFLOP/s": round(flops / ms / 1e9, 1)}
    if not args.skip_peer:
        res.update(_prefill_peer(q, paged, qsl_list, out, scale, flops, bench))
    return res


def _prefill_peer(q, paged: Paged, qsl_list: list[int], out, scale, flops, bench) -> dict:
    """SDPA per prompt (no varlen in SDPA), causal, on contiguous K/V."""
    kvs = [paged.contiguous_kv(i) for i in range(len(qsl_list) - 1)]
    qs = [q[a:b].transpose(0, 1).unsqueeze(0) for a, b in zip(qsl_list, qsl_list[1:])]  # [1, H, L, D]

    def peer() -> list[torch.Tensor]:
        return [sdpa(qi, k, v, causal=True, scale=scale) for qi, (k, v) in zip(qs, kvs)]

    ref = torch.cat([o.squeeze(0).transpose(0, 1) for o in peer()])
    ms = bench(peer)
    return {"peer_ms": round(ms, 4), "peer_TFLOP/s": round(flops / ms / 1e9, 1), "max_rel_err": max_rel_err(out, ref)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--skip-peer", action="store_true", help="do not time SDPA")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (needs TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    args.device = "cpu" if args.smoke else "cuda"
    args.num_sms = 132
    if args.smoke:
        args.dtype = torch.float16  # the interpreter mis-multiplies bf16 in tl.dot
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    else:
        args.num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bench = timer(args.smoke)
    decode_cases = [(2, 40), (1, 300)] if args.smoke else DECODE_CASES
    lens = [5, 40, 17] if args.smoke else prefill_lens(PREFILL_PROMPTS)
    if not args.smoke:
        print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "triton": __import__("triton").__version__, "num_sms": args.num_sms}), flush=True)
    for model in args.models:
        for batch, ctx in decode_cases:
            print(json.dumps(bench_decode(model, batch, ctx, args, bench)), flush=True)
            if not args.smoke:
                torch.cuda.empty_cache()
        print(json.dumps(bench_prefill(model, lens, args, bench)), flush=True)


if __name__ == "__main__":
    main()
