"""Triton GEMV for the dense linears of a batch-1 decode step: y = x @ W.T (+ b), x [M, K] with
M <= GEMV_MAX_ROWS, W [N, K] (nn.Linear's layout: rows contiguous along K), in bf16/fp16/fp32.

Why (issue 21): with one token a step, a linear is bound by reading its weight once. cuBLAS
reads the attention and router weights of Qwen3-30B-A3B's layers (16-21 MB each) at ~1.55 TB/s
in a batch-1 step (lease 9's profile) and Llama-3.1-8B's o_proj at 2.1 TB/s (lease 7): its M = 1
kernels leave part of the GPU idle on these narrow shapes. Here each program streams a
[BLOCK_N, K / SPLIT_K] slice of W with 16-byte loads along K and keeps an fp32
[BLOCK_N, BLOCK_K] accumulator in registers, reduced once at the end (no tensor cores: a
1-row product would use 1/16 of an MMA tile). Rows beyond the first re-read the weight tile
from L2 (one program row per activation row). One row with K <= STREAM_MAX_K takes the streaming
kernel instead (`dense_gemv_stream`, below): persistent programs over whole-row tiles.

Split-K: kernels/split_k.py's fix-up (as the W4A16 GEMV): partial tiles go to an fp32
workspace and the last program of a tile, by an atomic counter, adds them in the fixed order
0..SPLIT_K-1 and stores the result: one launch, valid in CUDA graphs. The bias is added by the
program with pid_k 0, so exactly once.

The tile per (N, K) comes from `kernels/configs/dense_gemv/<GPU>.json` (scripts/
bench_dense_gemv.py --sweep writes it, with cuBLAS's time beside each shape); `use_gemv` says
whether a layer takes the GEMV: only shapes the sweep measured faster than cuBLAS, unless
MINIVLLM_DENSE_GEMV=1 forces it for every shape (0: never). The reference is F.linear.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minivllm.kernels.device import num_sms as num_sms_of
from minivllm.kernels.pdl import enter_after_previous, pdl_args, prefetch_rows, prefetch_span
from minivllm.kernels.split_k import split_buffers, split_count, store_tile
from minivllm.kernels.tuned_tables import device_table, table_file

GEMV_MAX_ROWS = 2  # batch-1 decode (and 2-row graphs); more rows: cuBLAS reads the weight once for all
DEFAULT_TILE = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
PROGRAMS_PER_SM = 4  # split K until about this many programs per SM (as the W4A16 GEMV)
MAX_SPLIT_K = 16
PREFETCH_BYTES = 1024  # of each program's weight rows (at most its slice), into L2 before the PDL wait (kernels/pdl.py)
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "dense_gemv")
# The streaming variant (dense_gemv_stream), which one-row steps of every GEMV layer with K up to
# STREAM_MAX_K take (MINIVLLM_DENSE_GEMV_STREAM=0: the split-K GEMV above, to compare): a
# persistent grid walking whole-row tiles, the next tile's loads issued before the current tile
# is computed, as fused_moe's streaming MoE kernels. Lease 25 (H100, same lease): W10-decode
# 3.47 -> 3.38 ms a token (60.8 % of the roofline), W2 5.71 -> 5.73 (no change).
STREAM = os.environ.get("MINIVLLM_DENSE_GEMV_STREAM", "1") != "0"
# (lease 24, bench_dense_gemv.py --stream: within 0.1-0.3 us of each shape's best on
# Qwen3-30B-A3B's qkv / o / router and Llama-3.1-8B's qkv / o / gate_up)
STREAM_TILE = {"BLOCK_N": 4, "num_warps": 8, "programs_per_sm": 4}
STREAM_MAX_K = 4096


@triton.jit
def _dense_gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr,
):
    """Program (n, m, k): out[m, n-tile] (its K slice k with SPLIT_K > 1). x and W are read
    with unit stride along K. With PDL (kernels/pdl.py) the first PREFETCH weight elements of the
    slice are requested into L2 before waiting for the kernel that writes x."""
    pid_n, m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    rn_safe = tl.where(n_ok, rn, 0)  # rows past N read row 0 (never stored): unmasked loads along N
    w_rows = w_ptr + rn_safe.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_end = tl.minimum((pid_k + 1) * per_split, k_tiles)
    prefetch_rows(w_rows, pid_k * per_split * BLOCK_K, tl.minimum(t_end * BLOCK_K, K) - 1, PREFETCH, LINE, PDL)
    enter_after_previous(PDL)
    for t in range(pid_k * per_split, t_end):
        kk = t * BLOCK_K + rk
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :])
            xv = tl.load(x_ptr + m * stride_xm + kk)
        else:
            k_ok = kk < K
            w = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
            xv = tl.load(x_ptr + m * stride_xm + kk, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    out = tl.sum(acc, 1)  # [BLOCK_N]
    if HAS_BIAS:
        if pid_k == 0:
            out += tl.load(b_ptr + rn_safe).to(tl.float32)
    store_tile(out, out_ptr, ws_ptr, cnt_ptr, m * stride_om + rn, m * N + rn, M * N, n_ok, pid_k,
                m * tl.num_programs(0) + pid_n, SPLIT_K)


@triton.jit
def _load_rows(w_ptr, t, tiles, N, K, stride_wn, rows, ks, BLOCK_N: tl.constexpr):
    """Rows t * BLOCK_N .. of W, whole (K_PAD wide), in W's dtype; zeros past N / K or t >= tiles.
    Through L2 only (.cg): a weight is read once a step, and the PTX check of the PDL contract
    (tests/unit/test_pdl_compile.py) tells these loads from x's."""
    r = t * BLOCK_N + rows
    live = tl.where(t < tiles, N, 0)  # a dead tile loads nothing
    return tl.load(w_ptr + tl.where(r < N, r, 0).to(tl.int64)[:, None] * stride_wn + ks[None, :],
                   mask=(r < live)[:, None] & (ks < K)[None, :], other=0.0, cache_modifier=".cg")


@triton.jit
def _dense_gemv_stream_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_wn, HAS_BIAS: tl.constexpr,
                              BLOCK_N: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr):
    """One row of x (M = 1): persistent program p computes the row tiles p, p + P, ... of
    out [1, N] over whole rows of W (K <= K_PAD) and loads tile t + P's weights before it
    computes tile t (two tiles of loads in flight per thread; one prologue per program).

    The weights are not written by any kernel of the step, so with PDL (kernels/pdl.py) the
    program's first tile is loaded into registers before the wait; x (the previous kernel's
    output) is read after it. (Only asking L2 for that tile there, as the split-K GEMV does, was
    slower on all six shapes of lease 24's sweep, by 0.04-1.24 us; removed.)"""
    p = tl.program_id(0)
    P = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, K_PAD)
    tiles = tl.cdiv(N, BLOCK_N)
    w = _load_rows(w_ptr, p, tiles, N, K, stride_wn, rows, ks, BLOCK_N)
    enter_after_previous(PDL)
    xv = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)[None, :]
    for t in range(p, tiles, P):
        w_next = _load_rows(w_ptr, t + P, tiles, N, K, stride_wn, rows, ks, BLOCK_N)
        acc = tl.sum(w.to(tl.float32) * xv, axis=1)
        r = t * BLOCK_N + rows
        if HAS_BIAS:
            acc += tl.load(b_ptr + r, mask=r < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + r, acc.to(out_ptr.dtype.element_ty), mask=r < N)
        w = w_next


def stream_fits(k: int) -> bool:
    """Whether the streaming GEMV holds whole rows of length k (rounded up to a power of two)."""
    return triton.next_power_of_2(k) <= STREAM_MAX_K


def dense_gemv_stream(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      tile: dict | None = None) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T + bias -> [1, N] through the streaming kernel (stream_fits(K)).
    tile: BLOCK_N, num_warps, programs_per_sm (STREAM_TILE; "programs": a fixed count, for tests)."""
    n, k = weight.shape
    assert x.shape == (1, k) and weight.stride(1) == 1 and x.stride(1) == 1 and stream_fits(k), (x.shape, weight.shape)
    tile = tile or STREAM_TILE
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    programs = min(triton.cdiv(n, tile["BLOCK_N"]),
                   tile.get("programs") or num_sms_of(x.device) * tile["programs_per_sm"])
    _dense_gemv_stream_kernel[(programs,)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=tile["BLOCK_N"], K_PAD=triton.next_power_of_2(k), num_warps=tile["num_warps"], **pdl_args(x))
    return out


def choose_split_k(n: int, k: int, tile: dict, num_sms: int) -> int:
    """Cut K until about PROGRAMS_PER_SM programs per SM (a power of two, at most MAX_SPLIT_K and
    the number of K tiles)."""
    return split_count(triton.cdiv(n, tile["BLOCK_N"]), triton.cdiv(k, tile["BLOCK_K"]), num_sms, PROGRAMS_PER_SM,
                       MAX_SPLIT_K)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               tile: dict | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (rows may be strided, K contiguous) @ weight[N, K].T + bias -> [M, N] in x's dtype.
    tile: BLOCK_N, BLOCK_K, num_warps, num_stages (DEFAULT_TILE); split_k None: choose_split_k."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1, (x.shape, weight.shape)
    tile = tile or DEFAULT_TILE
    if split_k is None:
        split_k = choose_split_k(n, k, tile, num_sms_of(x.device))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(n, tile["BLOCK_N"]), m, split_k)
    ws, cnt = split_buffers(split_k, m, n, grid[0] * grid[1], out)
    _dense_gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, out, ws, cnt, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % tile["BLOCK_K"] == 0, SPLIT_K=split_k,
        **prefetch_span(weight.dtype, PREFETCH_BYTES), **pdl_args(x), **tile)
    return out


# ---------------------------------------------------------------- which layers take it


def shape_key(n: int, k: int, dtype: torch.dtype) -> str:
    return f"N={n},K={k},dtype={str(dtype).removeprefix('torch.')}"


def config_file(device_name: str) -> str:
    return table_file(CONFIG_DIR, device_name)


@functools.lru_cache(maxsize=8)
def load_configs(device_name: str) -> dict:
    """The sweep's table for this GPU (or its sibling's, tuned_tables.device_table): shape_key ->
    {"tile": {...}, "gemv_us", "cublas_us"}."""
    return device_table(CONFIG_DIR, device_name)


def gemv_mode() -> str:
    """MINIVLLM_DENSE_GEMV: "1" every shape, "0" none, else "auto" (the sweep's winners)."""
    value = os.environ.get("MINIVLLM_DENSE_GEMV", "auto").strip().lower()
    return {"1": "on", "on": "on", "0": "off", "off": "off"}.get(value, "auto")


def pick_tile(n: int, k: int, dtype: torch.dtype, device_name: str, mode: str) -> dict | None:
    """The tile a layer of this shape uses for <= GEMV_MAX_ROWS rows, or None for cuBLAS."""
    if mode == "off":
        return None
    entry = load_configs(device_name).get(shape_key(n, k, dtype))
    if entry is not None and (mode == "on" or entry["gemv_us"] < entry["cublas_us"]):
        return dict(entry["tile"])
    return dict(DEFAULT_TILE) if mode == "on" else None


class GemvLinear(torch.nn.Module):
    """nn.Linear whose steps of at most GEMV_MAX_ROWS rows run the Triton GEMV (the same weight
    Parameter: tied weights stay tied; more rows: F.linear)."""

    def __init__(self, linear: torch.nn.Linear, tile: dict) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        # the launch is fixed per layer (the split depends on the weight, not the rows): resolved
        # once here, not on every decode step
        self.tile = dict(tile)
        self.split_k = self.tile.pop("SPLIT_K", None) or choose_split_k(
            self.out_features, self.in_features, self.tile, num_sms_of(self.weight.device))
        self.stream = STREAM and stream_fits(self.in_features)  # one row: the streaming kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stream and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1:
            return dense_gemv_stream(x, self.weight, self.bias)
        if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.stride(1) == 1:
            return dense_gemv(x, self.weight, self.bias, self.tile, self.split_k)
        return F.linear(x, self.weight, self.bias)


def make_linears_gemv(layers: torch.nn.Module) -> int:
    """Replace the CUDA nn.Linear modules under `layers` (the decoder layers: not the LM head,
    which cuBLAS reads at ~2.8 TB/s) that the sweep says are faster as a GEMV; returns how many."""
    mode = gemv_mode()
    targets = [(parent, name, child) for parent in layers.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and child.weight.device.type == "cuda"]
    done = 0
    for parent, name, child in targets:
        device_name = torch.cuda.get_device_name(child.weight.device)
        tile = pick_tile(child.out_features, child.in_features, child.weight.dtype, device_name, mode)
        if tile is not None:
            setattr(parent, name, GemvLinear(child, tile))
            done += 1
    return done
