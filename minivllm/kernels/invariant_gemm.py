"""Triton kernel: a matmul whose every output element is reduced in one fixed order, whatever
the number of rows (batch-invariant mode, models/batch_invariant.py).

cuBLAS picks a kernel, a tile shape and sometimes a split of K by the problem's shape, so the
same row of x times the same weight can give different bits in a batch of 1 and a batch of 64.
Here the K loop is fixed per weight: output element (m, n) is computed by a program whose tile
holds row m at some offset, walking its K range from the start in BLOCK_K steps with one fp32
accumulator; rows of a tile never mix, so which other rows share the tile (or whether they are
padding) does not change its bits. No autotuning by shape of the reduction, no stream-K.

    y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), accumulated in fp32, stored in x's dtype

K slices. Where a W1-sized batch (about 256 rows, 4 row tiles of 64) would leave the GPU under
two programs per SM, K is split by a count that is a function of N, K and the SM count alone
(`split_k_for`; a kept table may name another count for a weight on its GPU): every output
element is then the sum of SPLIT_K fp32 partials over fixed K ranges, added in the fixed order
0 .. SPLIT_K - 1, the same bits whatever the rows. Qwen3-0.6B's o_proj (K 2,048) and down_proj
(K 3,072) get 4 slices. Two ways to run the slices, with the same
bits: across programs (grid z = SPLIT_K; the tile's last program adds the partials from an fp32
workspace, kernels/split_k.py), the fast way for few rows; or in one program (`in_program`), which
walks the slices one after another and adds each partial to the running sum in that order, with
no workspace, the fast way for prefill-sized M (Qwen3-0.6B's down_proj at 8,192 rows: 317 -> 194 us).

The launch (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, in_program) is free: on an H100 every one
of 1,630 launches tried (tiles of 16-128 rows and 32-256 columns, K steps of 64-256, 4 or 8
warps, 3-5 stages, MMA v2 and wgmma alike) gave the bits of the others for the same weight's K
slices (lease 28, scripts/bench_invariant_gemm.py): the tensor cores accumulate each 16-wide K
step into the fp32 accumulator the same way whatever the tile. So `launch_for` picks the launch
by the row count, as cuBLAS does, from the kept table of that sweep
(kernels/configs/invariant_gemm/<GPU>.json); a GPU without a table, the CPU, and
MINIVLLM_INVARIANT_GEMM_TABLE=0 get the one fixed launch (64 rows, BLOCK_N by N, 64-wide K steps,
4 warps, 3 stages). tests/gpu/test_invariant_gemm.py checks the property for a set of launches
and for every launch of the kept table; a new GPU's table should be swept with the same checks.

Cost (H100, Qwen3-0.6B, a decode step's linears and LM head): 1.09 ms at 256 rows against 1.01
for cuBLAS and 1.41 with the fixed launch (o_proj and down_proj in one K slice since lease 31's
sweep); docs/perf.md states the mode's cost.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from minivllm.kernels.device import num_sms as num_sms_of
from minivllm.kernels.split_k import split_buffers, store_tile
from minivllm.kernels.tuned_tables import device_table, read_table

# the fixed launch (no table; the K slices' count is derived from its tiles). BLOCK_N is the
# widest of BLOCK_N_CHOICES that still gives REFERENCE_ROW_TILES x cdiv(N, BLOCK_N) >= the SM
# count (else the narrowest); MINIVLLM_INVARIANT_GEMM_TILE="BM,BN,BK,warps,stages" fixes one tile
# for every weight instead, with K unsplit (tuning runs only: that changes the bits)
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


def fixed_launch(n: int, num_sms: int) -> tuple[int, int, int, int, int]:
    """The launch without a table (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for a weight of n
    outputs: the one every row count used before the table."""
    return BLOCK_M, block_n_for(n, num_sms), BLOCK_K, NUM_WARPS, NUM_STAGES


def split_k_for(n: int, k: int, num_sms: int, entry: dict | None = None) -> int:
    """K slices for a weight of n outputs and k inputs (a function of the weight and the GPU
    only): the kept table's count for it (`entry`, table_entry's) if it has one, else 1 or the
    power of two that gives a W1-sized batch about two programs per SM."""
    if entry and entry.get("split_k"):
        return int(entry["split_k"])
    if os.environ.get(TILE_ENV) or n > SPLIT_MAX_N:
        return 1
    tiles = REFERENCE_ROW_TILES * triton.cdiv(n, block_n_for(n, num_sms))
    split = 1
    while split < MAX_SPLIT_K and tiles * split < 2 * num_sms and k // (2 * split) >= SPLIT_MIN_K_PER_SLICE:
        split *= 2
    return split


# "0": the fixed launch at every row count; a path ending in .json: that table instead of the
# kept one (A/B runs against an earlier sweep, e.g. docs/perf-data's copy of lease 30's table)
TABLE_ENV = "MINIVLLM_INVARIANT_GEMM_TABLE"
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "invariant_gemm")


@functools.lru_cache(maxsize=None)
def launch_table(device_name: str) -> dict:
    """The kept sweep for this GPU: "N=..,K=.." -> {"split_k": K slices (optional), "rows":
    [[max_rows, tile, in_program], ...] in rising max_rows} (scripts/bench_invariant_gemm.py
    --write-from); its sibling's (tuned_tables.device_table) or {} when none was kept.
    MINIVLLM_INVARIANT_GEMM_TABLE=<file>.json replaces it."""
    path = os.environ.get(TABLE_ENV, "")
    return read_table(path) if path.endswith(".json") else device_table(CONFIG_DIR, device_name)


@functools.lru_cache(maxsize=None)
def _device_entry(n: int, k: int, device_index: int) -> dict | None:
    return launch_table(torch.cuda.get_device_name(device_index)).get(f"N={n},K={k}")


def table_entry(n: int, k: int, device: torch.device) -> dict | None:
    """The kept table's entry for a weight [n, k] on this device (None: no table, no entry, the
    CPU, or MINIVLLM_INVARIANT_GEMM_TABLE=0 / the tile override)."""
    if os.environ.get(TILE_ENV) or device.type != "cuda" or os.environ.get(TABLE_ENV, "1") == "0":
        return None
    return _device_entry(n, k, torch.cuda.current_device() if device.index is None else device.index)


def launch_for(n: int, k: int, m: int, device: torch.device,
               entry: dict | None = None) -> tuple[tuple[int, int, int, int, int], bool]:
    """(tile, in_program) for m rows of a weight [n, k] (entry: its table_entry): the table's
    first bucket that holds m rows (its last for more), else the fixed launch. Any choice gives
    the same bits for the weight's K slices (tests/gpu/test_invariant_gemm.py), so the row count
    may pick it, as cuBLAS picks its kernels, without breaking the invariance."""
    if entry and entry.get("rows"):
        return bucket_launch(entry["rows"], m)
    return fixed_launch(n, num_sms_of(device)), False


def bucket_launch(buckets: list, m: int) -> tuple[tuple[int, int, int, int, int], bool]:
    """The launch of the first [max_rows, tile, in_program] bucket with m <= max_rows (buckets in
    rising max_rows; the last one for more rows)."""
    for max_rows, tile, in_program in buckets:
        if m <= max_rows:
            break
    return tuple(tile), bool(in_program)


@triton.jit
def _k_slice(x_rows, w_cols, rm, rn, M, N, K, t_begin, t_end, stride_xk, stride_wk, IEEE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 partial tile of K tiles [t_begin, t_end), walked in order from a zero accumulator."""
    rk = tl.arange(0, BLOCK_K)
    part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(t_begin, t_end):
        kk = t * BLOCK_K + rk
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_cols + kk[:, None] * stride_wk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if IEEE:  # float32 inputs: full-precision products, not TF32
            part = tl.dot(a, b, part, input_precision="ieee")
        else:
            part = tl.dot(a, b, part)
    return part


@triton.jit
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, IN_PROGRAM: tl.constexpr,
):
    # SPLIT_K slices of K, fixed per weight. Across programs (grid z = SPLIT_K, IN_PROGRAM False):
    # program pid_k computes slice pid_k and the tile's last program adds the SPLIT_K partials in
    # the order 0 .. SPLIT_K - 1 (split_k.store_tile). In one program (IN_PROGRAM, grid z = 1):
    # the program computes the slices one after another and adds each to the running sum in that
    # same order, so the bits are the same, with no workspace (the launch for many rows).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)  # slice s: K tiles [s * per_split, (s + 1) * per_split)
    first = 0 if IN_PROGRAM else pid_k
    acc = _k_slice(x_rows, w_cols, rm, rn, M, N, K, first * per_split, tl.minimum((first + 1) * per_split, k_tiles),
                   stride_xk, stride_wk, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        if first == 0:  # (added once: slice 0's partial carries it)
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if IN_PROGRAM:
        for s in tl.static_range(1, SPLIT_K):
            acc += _k_slice(x_rows, w_cols, rm, rn, M, N, K, s * per_split, tl.minimum((s + 1) * per_split, k_tiles),
                            stride_xk, stride_wk, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    y_off = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :] * stride_yn
    ws_off = rm.to(tl.int64)[:, None] * N + rn[None, :]
    store_tile(acc, y_ptr, ws_ptr, cnt_ptr, y_off, ws_off, M * N, mask, pid_k, pid_m * tl.num_programs(1) + pid_n,
               1 if IN_PROGRAM else SPLIT_K)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     tile: tuple[int, int, int, int, int] | None = None, in_program: bool = False,
                     split: int | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in x's dtype, batch-invariant (above).
    `tile` (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) and `in_program` replace the launch the
    table picks for the row count (the sweep of scripts/bench_invariant_gemm.py), with the same
    bits; `split` replaces the weight's K slices (sweeps only: that changes the bits)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"invariant_matmul: x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*lead, n)
    entry = table_entry(n, k, x.device)
    split = split or split_k_for(n, k, num_sms_of(x.device), entry)
    if tile is None:
        tile, in_program = launch_for(n, k, m, x.device, entry)
    block_m, block_n, block_k, warps, stages = tile
    in_program = in_program and split > 1
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), 1 if in_program else split)
    ws, cnt = split_buffers(grid[2], m, n, grid[0] * grid[1], y)
    _invariant_matmul_kernel[grid](
        x2, weight, bias if bias is not None else weight, y, ws, cnt, m, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split, IN_PROGRAM=in_program, num_warps=warps, num_stages=stages,
    )
    return y.view(*lead, n)
