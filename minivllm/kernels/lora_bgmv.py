"""Triton kernel: batched gather matrix-vector products for multi-LoRA ("bgmv").

Every token of a step may run with a different adapter. Each adapter's matrices sit in a device
slot of a stacked weight `w: [num_slots, N, K]`; `slots[t]` is token t's slot (-1: no adapter).
One program computes N_BLOCK outputs of one token:

    y[t, n] (+)= sum_k x[t, k] * w[slots[t], n, k]        (nothing for slots[t] == -1)

The same kernel serves both halves of LoRA: shrink (x [T, in], w = A [S, R, in] -> [T, R]) and
expand (x [T, R], w = B [S, out, R], added into the base layer's output). Accumulation is in
float32. Padding tokens of a CUDA graph carry slot -1, so the kernel needs no host sync and is
graph-safe. The reference is `lora_delta_reference` in minivllm/lora/ops.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bgmv_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [S, N, K]
    y_ptr,  # [T, N]
    slot_ptr,  # [T] int32/int64, -1: no adapter
    N, K,
    stride_xt, stride_ws, stride_wn, stride_yt,
    ACCUMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # a token without an adapter: every mask is empty (no loads, no store)
    n_lim = tl.where(slot >= 0, N, 0)
    k_lim = tl.where(slot >= 0, K, 0)
    slot = tl.maximum(slot, 0)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_lim
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_lim
        xv = tl.load(x_ptr + t * stride_xt + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + slot * stride_ws + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * xv[None, :], axis=1)
    y_ptrs = y_ptr + t * stride_yt + offs_n
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def bgmv(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, y: torch.Tensor, accumulate: bool) -> None:
    """y[t] (+)= w[slots[t]] @ x[t] for every token with slots[t] >= 0; rows of slot -1 are not
    written at all. x: [T, K], w: [S, N, K], y: [T, N] (each contiguous in its last dim), slots: [>= T]."""
    t, k = x.shape
    n = w.shape[1]
    assert w.shape[2] == k and y.shape == (t, n) and slots.shape[0] >= t
    assert x.stride(1) == 1 and w.stride(2) == 1 and y.stride(1) == 1
    if t == 0:
        return
    block_n = min(64, triton.next_power_of_2(n))
    block_k = min(128, triton.next_power_of_2(k))
    grid = (t, triton.cdiv(n, block_n))
    _bgmv_kernel[grid](x, w, y, slots, n, k, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
                       ACCUMULATE=accumulate, BLOCK_N=block_n, BLOCK_K=block_k)
