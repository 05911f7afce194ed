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

Where even the narrowest tiles leave a W1-sized batch under two programs per SM, K is split too,
by a count that is again a function of N, K and the SM count alone (`split_k_for`): every output
element is then the sum of SPLIT_K fp32 partials over fixed K ranges, added in the fixed order
0 .. SPLIT_K - 1 by the tile's last program (kernels/split_k.py), the same bits whatever the
rows. Qwen3-0.6B's o_proj (K 2,048) and down_proj (K 3,072) get 4 slices: 512 programs of 8
and 12 K steps instead of 128 programs of 32 and 48. The fp32 workspace is SPLIT_K x M x N:
only narrow weights split (N <= SPLIT_MAX_N), which bounds it at a prefill step's M.

Cost: the tile wastes most of its rows at decode sizes (M = 1-16) and is below cuBLAS's best at
large M; the mode states its cost in docs/perf.md.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from minivllm.kernels.device import num_sms as num_sms_of
from minivllm.kernels.split_k import split_buffers, store_tile

# the fixed launch: changing any of these changes the bits (not the correctness). BLOCK_N is the
# widest of BLOCK_N_CHOICES that still gives REFERENCE_ROW_TILES x cdiv(N, BLOCK_N) >= the SM
# count (else the narrowest); MINIVLLM_INVARIANT_GEMM_TILE="BM,BN,BK,warps,stages" fixes one tile
# for every weight instead (tuning runs only)
TILE_ENV = "MINIVLLM_INVARIANT_GEMM_TILE"
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = (
    tuple(int(v) for v in os.environ[TILE_ENV].split(",")) if os.environ.get(TILE_ENV) else (64, 128, 64, 4, 3))
BLOCK_N_CHOICES = (128, 64, 32)
REFERENCE_ROW_TILES = 4  # a W1-sized decode batch: 256 rows in tiles of 64
SPLIT_MAX_N = 2048  # wider weights never split K (their tiles fill the GPU; the workspace stays small)
SPLIT_MIN_K_PER_SLICE = 512  # each K slice keeps at least 8 steps of BLOCK_K
MAX_SPLIT_K = 4


def block_n_for(n: int, num_sms: int) -> int:
    """The tile width for a weight of n output features (a function of n and the GPU only)."""
    if os.environ.get(TILE_ENV):
        return BLOCK_N
    for bn in BLOCK_N_CHOICES:
        if REFERENCE_ROW_TILES * triton.cdiv(n, bn) >= num_sms:
            return bn
    return BLOCK_N_CHOICES[-1]


def split_k_for(n: int, k: int, num_sms: int) -> int:
    """K slices for a weight of n outputs and k inputs (a function of the weight and the GPU
    only): 1, or the power of two that gives a W1-sized batch about two programs per SM."""
    if os.environ.get(TILE_ENV) or n > SPLIT_MAX_N:
        return 1
    tiles = REFERENCE_ROW_TILES * triton.cdiv(n, block_n_for(n, num_sms))
    split = 1
    while split < MAX_SPLIT_K and tiles * split < 2 * num_sms and k // (2 * split) >= SPLIT_MIN_K_PER_SLICE:
        split *= 2
    return split


@triton.jit
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)  # slice pid_k: K tiles [pid_k * per_split, ...), fixed per weight
    for t in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, k_tiles)):
        kk = t * BLOCK_K + rk
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_cols + kk[:, None] * stride_wk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if IEEE:  # float32 inputs: full-precision products, not TF32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        if pid_k == 0:  # (added once: slice 0's partial carries it)
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    y_off = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :] * stride_yn
    ws_off = rm.to(tl.int64)[:, None] * N + rn[None, :]
    store_tile(acc, y_ptr, ws_ptr, cnt_ptr, y_off, ws_off, M * N, mask, pid_k, pid_m * tl.num_programs(1) + pid_n,
               SPLIT_K)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in x's dtype, batch-invariant (above).
    `tile` (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) replaces the fixed launch (the sweep of
    scripts/bench_invariant_gemm.py; K is still split as the weight's fixed count says)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"invariant_matmul: x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*lead, n)
    sms = num_sms_of(x.device)
    split = split_k_for(n, k, sms)
    block_m, block_n, block_k, warps, stages = tile or (BLOCK_M, block_n_for(n, sms), BLOCK_K, NUM_WARPS, NUM_STAGES)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    ws, cnt = split_buffers(split, m, n, grid[0] * grid[1], y)
    _invariant_matmul_kernel[grid](
        x2, weight, bias if bias is not None else weight, y, ws, cnt, m, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split, num_warps=warps, num_stages=stages,
    )
    return y.view(*lead, n)
