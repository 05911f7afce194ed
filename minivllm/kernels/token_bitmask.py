"""Triton kernel: apply the grammar's token bitmask to the logits, in place, for the whole batch.

Program (r, b) covers vocabulary columns [b * BLOCK, (b + 1) * BLOCK) of logits row rows[r]:
bit t % 32 of bitmask word [r, t // 32] is 1 when token t is allowed; a disallowed token's
logit becomes -inf. Only those are written (the logits are never read). The reference is
`apply_token_bitmask_torch` in minivllm/structured/bitmask.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [B, V] float
    bitmask_ptr,  # [R, W] int32, W * 32 >= V
    rows_ptr,  # [R] int64: the logits row of each bitmask row
    stride_logits, stride_bitmask,
    vocab_size,
    BLOCK: tl.constexpr,  # columns per program, a multiple of 32
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab_size
    row = tl.load(rows_ptr + r).to(tl.int64)
    words = tl.load(bitmask_ptr + r * stride_bitmask + cols // 32, mask=in_vocab, other=-1)
    blocked = ((words >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + cols, float("-inf"), mask=in_vocab & blocked)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                               block: int = 4096) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (see the module docstring)."""
    num_rows, width = bitmask.shape
    vocab_size = logits.shape[1]
    assert width * 32 >= vocab_size, (bitmask.shape, logits.shape)
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and bitmask.dtype == torch.int32
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(vocab_size, block))
    _apply_token_bitmask_kernel[grid](logits, bitmask, rows, logits.stride(0), bitmask.stride(0), vocab_size,
                                      BLOCK=block)
