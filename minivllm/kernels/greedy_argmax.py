"""Greedy sampling's argmax over the vocabulary in one launch, spread over many programs (GPU).

Why: torch's `logits.argmax(-1)` reduces a row with one block, so at batch 1 a 128,256-token row
takes ~35 us on an H200, a launch that moves 256 KB (lease 55's W11-awq profile: 0.035 of a
2.6 ms token, as much as a layer's attention). Here program (r, c) reduces chunk c of row r
(CHUNK tokens) to its maximum and the first token holding it; the last program of row r to
finish (its int32 counter, as kernels/split_k.py's fix-up counts a tile's K slices) picks, over
the row's chunks, the first chunk holding the row's maximum, so its token is the row's first
maximum: torch.argmax's answer, ties included.

NaN: torch.argmax returns the first NaN's index when a row holds one; so does this (a chunk with
a NaN reports it, and a NaN chunk beats every number). Rows of -inf only give token 0, as torch.

`greedy_argmax(logits)` runs the kernel on CUDA (MINIVLLM_ARGMAX_KERNEL=0: torch.argmax, for A/B
runs) and torch.argmax elsewhere. tests/gpu/test_greedy_argmax.py checks it against torch.argmax
(ties, NaN, -inf, every dtype); tests/unit/test_greedy_argmax_interpret.py runs those checks
under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import os

import torch

from minivllm.kernels.fused_ops import _jit, triton

if triton is not None:
    import triton.language as tl

    from minivllm.kernels.split_k import tile_counters
else:
    tl = None

CHUNK = 2048  # tokens a program: Llama-3's 128,256-token row is 63 programs, Qwen3's 151,936 is 75
NUM_WARPS = 4


@_jit
def _argmax_kernel(x_ptr, stride_x, val_ptr, idx_ptr, cnt_ptr, out_ptr, V, num_chunks,
                   CHUNK: tl.constexpr, C_PAD: tl.constexpr):
    """Program (r, c): chunk c of row r -> (val, idx) at slot r * num_chunks + c, where idx is
    the chunk's first maximum (or first NaN, then val is NaN); the row's last program to count
    merges the row's slots into out[r] (int64)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    tok = c * CHUNK + tl.arange(0, CHUNK)
    ok = tok < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + tok, mask=ok, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan, tok, V), axis=0)
    best = tl.max(tl.where(is_nan, float("-inf"), x), axis=0)
    first_best = tl.min(tl.where((x == best) & ok, tok, V), axis=0)
    val = tl.where(first_nan < V, float("nan"), best)
    idx = tl.where(first_nan < V, first_nan, first_best)
    slot = row * num_chunks + c
    tl.store(val_ptr + slot, val)
    tl.store(idx_ptr + slot, idx)
    # as split_k.store_tile: the CTA barrier orders the stores before the (acq_rel, gpu-scope)
    # increment; the last program's acquire then sees every chunk's slot, read through L2 (.cg)
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + row, 1) == num_chunks - 1:
        cs = tl.arange(0, C_PAD)
        c_ok = cs < num_chunks
        vals = tl.load(val_ptr + row * num_chunks + cs, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(idx_ptr + row * num_chunks + cs, mask=c_ok, other=V, cache_modifier=".cg")
        c_nan = (vals != vals) & c_ok
        nan_idx = tl.min(tl.where(c_nan, idxs, V), axis=0)  # chunks are in token order: the first NaN
        top = tl.max(tl.where(c_nan, float("-inf"), vals), axis=0)
        top_idx = tl.min(tl.where((vals == top) & c_ok, idxs, V), axis=0)  # the first chunk holding the max
        tl.store(out_ptr + row, tl.where(nan_idx < V, nan_idx, top_idx).to(tl.int64))
        tl.store(cnt_ptr + row, 0)  # every program of the row has counted: 0 again for the next launch


def kernel_enabled(logits: torch.Tensor) -> bool:
    """Whether greedy_argmax runs the kernel: CUDA logits [B, V] and MINIVLLM_ARGMAX_KERNEL not
    "0" (read at each call, so a benchmark can flip it)."""
    return (triton is not None and logits.is_cuda and logits.dim() == 2
            and os.environ.get("MINIVLLM_ARGMAX_KERNEL", "1") != "0")


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype; not modified) -> [B] int64, torch.argmax(logits, -1)."""
    if not kernel_enabled(logits):
        return logits.argmax(dim=-1)
    return argmax_rows(logits)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The kernel itself on any device Triton runs on (the interpreter too): [B, V] -> [B] int64."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax of an empty vocabulary")
    num_chunks = triton.cdiv(vocab, CHUNK)
    vals = torch.empty(rows * num_chunks, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(rows * num_chunks, dtype=torch.int32, device=logits.device)
    _argmax_kernel[(rows, num_chunks)](
        logits, logits.stride(0), vals, idxs, tile_counters(logits.device, rows), out, vocab, num_chunks,
        CHUNK=CHUNK, C_PAD=max(2, triton.next_power_of_2(num_chunks)), num_warps=NUM_WARPS)
    return out
