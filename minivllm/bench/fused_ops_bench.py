"""Microbenchmark of the fused per-token kernels (kernels/fused_ops.py) against the torch ops they replace.

    python -m minivllm.bench.fused_ops_bench                    # on a CUDA GPU, prints JSON lines
    python -m minivllm.bench.fused_ops_bench --models llama-8b --tokens 1 16384
    TRITON_INTERPRET=1 python -m minivllm.bench.fused_ops_bench --smoke   # CPU plumbing check only

For each model shape and token count: rms_norm [T, H], fused_add_rms_norm [T, H] (out of place),
apply_rotary on q/k strided views of a fused qkv buffer (in place), and silu_and_mul [T, 2I].
Times are medians of triton.testing.do_bench (which flushes L2 between runs), in microseconds;
`*_gbps` is the achieved bandwidth = bytes the op must move (read + write once) / time, the same
byte count for both sides. The torch side is the eager torch math the layers use on the CPU
(several kernels, intermediates in fp32). `max_abs_err` compares the two outputs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from minivllm.kernels import fused_ops as F

MODELS = {  # name -> (hidden, num_heads, num_kv_heads, head_dim, intermediate)
    "qwen3-0.6b": (1024, 16, 8, 128, 3072),
    "llama-8b": (4096, 32, 8, 128, 14336),
}
TOKENS = [1, 256, 16384]
MAX_POS = 40960
EPS = 1e-6


def timer(smoke: bool) -> Callable[[Callable[[], object]], float]:
    """Median microseconds of fn()."""
    if smoke:
        def cpu_time(fn: Callable[[], object]) -> float:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        return cpu_time
    import triton.testing

    return lambda fn: 1e3 * float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _row(op: str, model: str, tokens: int, nbytes: int, t_triton: float, t_torch: float, err: float) -> dict:
    return {"op": op, "model": model, "tokens": tokens, "bytes": nbytes,
            "triton_us": round(t_triton, 2), "torch_us": round(t_torch, 2),
            "triton_gbps": round(nbytes / t_triton / 1e3, 1), "torch_gbps": round(nbytes / t_torch / 1e3, 1),
            "speedup": round(t_torch / t_triton, 2), "max_abs_err": err}


def bench_model(model: str, tokens: int, args: argparse.Namespace, bench: Callable) -> list[dict]:
    hidden, nq, nk, head_dim, inter = MODELS[model]
    dt, dev, es = args.dtype, args.device, args.dtype.itemsize
    gen = torch.Generator(device=dev).manual_seed(tokens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(dt)

    rows = []
    x, res, w = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
    nbytes = 2 * tokens * hidden * es + hidden * es
    rows.append(_row("rms_norm", model, tokens, nbytes, bench(lambda: F.rms_norm_triton(x, w, EPS)),
                     bench(lambda: F.rms_norm_torch(x, w, EPS)),
                     _err(F.rms_norm_triton(x, w, EPS), F.rms_norm_torch(x, w, EPS))))
    nbytes = 4 * tokens * hidden * es + hidden * es
    rows.append(_row("fused_add_rms_norm", model, tokens, nbytes,
                     bench(lambda: F.fused_add_rms_norm_triton(x, res, w, EPS)),
                     bench(lambda: F.fused_add_rms_norm_torch(x, res, w, EPS)),
                     _err(F.fused_add_rms_norm_triton(x, res, w, EPS)[0], F.fused_add_rms_norm_torch(x, res, w, EPS)[0])))

    q_size, kv_size = nq * head_dim, nk * head_dim
    qkv = rand(tokens, q_size + 2 * kv_size)
    q, k = qkv[:, :q_size].view(tokens, nq, head_dim), qkv[:, q_size:q_size + kv_size].view(tokens, nk, head_dim)
    cos_sin = torch.randn(MAX_POS, head_dim, generator=gen, device=dev)
    pos = torch.randint(0, MAX_POS, (tokens,), generator=gen, device=dev)
    ref_q, _ = F.apply_rotary_torch(pos, q, k, cos_sin)  # before the in-place runs below
    err = _err(F.apply_rotary_triton(pos, q, k, cos_sin)[0], ref_q)
    nbytes = 2 * tokens * (nq + nk) * head_dim * es + tokens * (head_dim * 4 + pos.element_size())
    rows.append(_row("apply_rotary", model, tokens, nbytes, bench(lambda: F.apply_rotary_triton(pos, q, k, cos_sin)),
                     bench(lambda: F.apply_rotary_torch(pos, q, k, cos_sin)), err))

    gate_up = rand(tokens, 2 * inter)
    nbytes = 3 * tokens * inter * es
    rows.append(_row("silu_and_mul", model, tokens, nbytes, bench(lambda: F.silu_and_mul_triton(gate_up)),
                     bench(lambda: F.silu_and_mul_torch(gate_up)),
                     _err(F.silu_and_mul_triton(gate_up), F.silu_and_mul_torch(gate_up))))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--smoke", action="store_true", help="tiny token counts on the CPU (needs TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    args.device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.tokens = [1, 3]
        args.dtype = torch.float16  # the interpreter's bf16 conversions do not round like the GPU's
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bench = timer(args.smoke)
    if not args.smoke:
        print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "triton": __import__("triton").__version__, "dtype": str(args.dtype)}), flush=True)
    for model in args.models:
        for tokens in args.tokens:
            for row in bench_model(model, tokens, args, bench):
                print(json.dumps(row), flush=True)
            if not args.smoke:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
