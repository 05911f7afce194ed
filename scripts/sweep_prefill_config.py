"""Development probe: prefill-attention TFLOP/s against the tile configuration (Qwen3-8B heads:
32 query / 8 kv heads, head_dim 128), on two serving-like steps: 8 fresh prompts U[100, 1024]
(a W3 burst) and one 1,000-token prompt beside 60 decode tokens of ~1,000-token contexts (a
rate-16 mixed step). Also a max_query_len fixed to the token count, as in a mixed CUDA graph.

    python3 scripts/sweep_prefill_config.py
"""

import itertools
import json
import random

import torch

from minivllm.bench.kernel_bench import build_paged, timer
from minivllm.kernels import prefill_attention as pa


def case(lens_q: list[int], lens_ctx: list[int]):
    paged = build_paged(lens_ctx, 8, 128, torch.bfloat16, "cuda")
    total = sum(lens_q)
    q = torch.randn(total, 32, 128, device="cuda").to(torch.bfloat16)
    qsl = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device="cuda")
    flops = 4 * 32 * 128 * sum(c * q_ - q_ * (q_ - 1) // 2 for q_, c in zip(lens_q, lens_ctx))
    return paged, q, qsl, flops


def main() -> None:
    rng = random.Random(0)
    burst = [rng.randint(100, 1024) for _ in range(8)]
    mixed_q = [1000] + [1] * 60
    mixed_ctx = [1000] + [rng.randint(500, 1500) for _ in range(60)]
    cases = {"burst": case(burst, burst), "mixed": case(mixed_q, mixed_ctx)}
    bench = timer(False)
    original = pa.prefill_config
    for block_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        pa.prefill_config = lambda *a, **k: {"BLOCK_M": block_m, "BLOCK_N": block_n,  # noqa: E731
                                              "num_warps": warps, "num_stages": stages}
        row = {"BLOCK_M": block_m, "BLOCK_N": block_n, "warps": warps, "stages": stages}
        for name, (paged, q, qsl, flops) in cases.items():
            out = torch.empty_like(q)
            try:
                ms = bench(lambda: pa.prefill_attention(q, paged.k_cache, paged.v_cache, qsl, paged.seq_lens,
                                                        paged.block_tables, 128**-0.5, max_query_len=q.shape[0],
                                                        out=out))
                row[name] = round(flops / ms / 1e9, 1)
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                row[name] = type(e).__name__
        print(json.dumps(row), flush=True)
    pa.prefill_config = original
    print("default", json.dumps(original(4, 128, 1000)))


if __name__ == "__main__":
    main()
