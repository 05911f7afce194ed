"""Triton kernel: segmented gather matrix multiply for multi-LoRA ("sgmv").

Every token of a step may run with a different adapter. Each adapter's matrices sit in a device
slot of a stacked weight `w: [num_slots, N, K]`. The step's tokens are grouped by slot on the
host (lora/manager.py): `order` lists the token rows slot by slot, slot s owning
order[start[s] : start[s] + count[s]]. One program computes a [BLOCK_M, BLOCK_N] tile of one
slot's tokens with tensor-core dots, so a slot's weight tile is read once per BLOCK_M of its
tokens (the per-token gather it replaced read it once per token: W1 with 4 adapters lost about a
third of its throughput then, 22.5 % with this kernel, vLLM 29 %; docs/perf.md):

    y[t, n] (+)= sum_k x[t, k] * w[s, n, k]        for every t in slot s's segment

Tokens in no segment (the base model, CUDA-graph padding) are never read or written. The same
kernel serves both halves of LoRA: shrink (x [T, in], w = A [S, R, in] -> [T, R], float32) and
expand (x [T, R], w = B [S, out, R], added into the base layer's output). Accumulation is in
float32; the grid is fixed by T and the slot count, so it is graph-safe. The reference is
`lora_delta_reference` in minivllm/lora/ops.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sgmv_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [S, N, K]
    y_ptr,  # [T, N]
    order_ptr,  # [>= T] int32: token rows grouped by slot
    start_ptr,  # [S] int32: where slot s's rows begin in order
    count_ptr,  # [S] int32: how many rows slot s has this step
    N, K,
    stride_xt, stride_ws, stride_wn, stride_yt,
    ACCUMULATE: tl.constexpr,
    IEEE: tl.constexpr,  # float32 weights: exact float32 dots (tests), not TF32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    s = tl.program_id(0)
    mb = tl.program_id(1)
    nb = tl.program_id(2)
    count = tl.load(count_ptr + s)
    # programs past the end of their slot's segment (most of them when a slot has few tokens)
    # leave at once: every mask below would be empty
    if mb * BLOCK_M >= count:
        return
    start = tl.load(start_ptr + s)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    rows = tl.load(order_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_base = w_ptr + s.to(tl.int64) * stride_ws
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        xv = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                     other=0.0)
        wv = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                     other=0.0)  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc = tl.dot(xv.to(wv.dtype), wv, acc, input_precision="ieee")
        else:
            acc = tl.dot(xv.to(wv.dtype), wv, acc)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def sgmv(x: torch.Tensor, w: torch.Tensor, order: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
         y: torch.Tensor, accumulate: bool) -> None:
    """y[t] (+)= w[s] @ x[t] for every row t of slot s's segment (order, start, count as in the
    module docstring); other rows of y are not written. x: [T, K], w: [S, N, K], y: [T, N] (each
    contiguous in its last dim); order: [>= T], start and count: [S]."""
    t, k = x.shape
    slots, n = w.shape[0], w.shape[1]
    assert w.shape[2] == k and y.shape == (t, n) and order.shape[0] >= t and count.shape[0] >= slots
    assert x.stride(1) == 1 and w.stride(2) == 1 and y.stride(1) == 1
    if t == 0:
        return
    block_m = 16 if t <= 64 else 64  # decode batches: few rows per slot; prefill: long segments
    block_n = max(16, min(128 if k <= 64 else 64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    grid = (slots, triton.cdiv(t, block_m), triton.cdiv(n, block_n))
    _sgmv_kernel[grid](x, w, y, order, start, count, n, k, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
                       ACCUMULATE=accumulate, IEEE=w.dtype == torch.float32,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
