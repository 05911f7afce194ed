"""Triton kernel: a matmul whose every output element is reduced in one fixed order, whatever
the number of rows (batch-invariant mode, models/batch_invariant.py).

cuBLAS picks a kernel, a tile shape and sometimes a split of K by the problem's shape, so the
same row of x times the same weight can give different bits in a batch of 1 and a batch of 64.
Here the tile shape, the warps and the K loop are constants: output element (m, n) is always
computed by a program whose tile holds row m at some offset, walking K from 0 in BLOCK_K steps
with one fp32 accumulator and the same MMA instruction sequence; rows of a tile never mix, so
which other rows share the tile (or whether they are padding) does not change its bits. No
split-K, no autotuning, no stream-K.

    y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), accumulated in fp32, stored in x's dtype

The tile's width BLOCK_N is chosen per weight, from N alone (and the GPU's SM count), never
from M: every call with this weight runs the same programs over K, so a row's bits still do not
depend on the batch. A narrow weight gets narrow tiles so that a W1-sized batch (about 256 rows,
4 row tiles of 64) still gives every SM a program: with one 64 x 128 tile, Qwen3-0.6B's o_proj
and down_proj (N = 1,024) ran 32 programs on an H100's 132 SMs.

Cost: the tile wastes most of its rows at decode sizes (M = 1-16) and is below cuBLAS's best at
large M; the mode states its cost in docs/perf.md.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from minivllm.kernels.device import num_sms as num_sms_of

# the fixed launch: changing any of these changes the bits (not the correctness). BLOCK_N is the
# widest of BLOCK_N_CHOICES that still gives REFERENCE_ROW_TILES x cdiv(N, BLOCK_N) >= the SM
# count (else the narrowest); MINIVLLM_INVARIANT_GEMM_TILE="BM,BN,BK,warps,stages" fixes one tile
# for every weight instead (tuning runs only)
TILE_ENV = "MINIVLLM_INVARIANT_GEMM_TILE"
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = (
    tuple(int(v) for v in os.environ[TILE_ENV].split(",")) if os.environ.get(TILE_ENV) else (64, 128, 64, 4, 3))
BLOCK_N_CHOICES = (128, 64, 32)
REFERENCE_ROW_TILES = 4  # a W1-sized decode batch: 256 rows in tiles of 64


def block_n_for(n: int, num_sms: int) -> int:
    """The tile width for a weight of n output features (a function of n and the GPU only)."""
    if os.environ.get(TILE_ENV):
        return BLOCK_N
    for bn in BLOCK_N_CHOICES:
        if REFERENCE_ROW_TILES * triton.cdiv(n, bn) >= num_sms:
            return bn
    return BLOCK_N_CHOICES[-1]


@triton.jit
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_cols + kk[:, None] * stride_wk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if IEEE:  # float32 inputs: full-precision products, not TF32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in x's dtype, batch-invariant (above)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"invariant_matmul: x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*lead, n)
    block_n = block_n_for(n, num_sms_of(x.device))
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n))
    _invariant_matmul_kernel[grid](
        x2, weight, bias if bias is not None else weight, y, m, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return y.view(*lead, n)
