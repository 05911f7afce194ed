"""The step's grammar bitmask (plain data for the runner) and its application to the logits.

The manager fills one int32 bitmask for every constrained row of a step at once; the runner
moves it to the device and applies it to the logits before sampling and before logprobs are
taken (a disallowed token gets -inf, so its logprob is -inf too). On CUDA one Triton kernel
covers the batch (kernels/token_bitmask.py); on the CPU the bits are unpacked with vectorised
torch ops, which is also the reference the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrammarBitmask:
    """Row i of `bitmask` constrains the next token of request req_ids[i] (a sampling row of
    the step); requests not listed are unconstrained this step."""

    req_ids: list[str]
    bitmask: torch.Tensor  # int32 [len(req_ids), ceil(vocab / 32)] on the host (pinned on CUDA)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0.

    logits: [B, V] float; bitmask: int32 [R, W] with W * 32 >= V; rows: int64 [R]; all three on
    the logits' device."""
    if logits.is_cuda:
        from minivllm.kernels.token_bitmask import apply_token_bitmask_triton
        apply_token_bitmask_triton(logits, bitmask, rows)
    else:
        apply_token_bitmask_torch(logits, bitmask, rows)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    vocab = logits.shape[1]
    assert bitmask.shape[1] * 32 >= vocab, (bitmask.shape, logits.shape)
    # the int32 words as bytes (little endian: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7),
    # unpacked 8 bits at a time: a quarter of the memory of unpacking 32-bit words
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [R, 4W]
    blocked = ((as_bytes.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab] == 0  # [R, V]
    if rows.shape[0] == logits.shape[0] and bool((rows == torch.arange(rows.shape[0], device=rows.device)).all()):
        logits.masked_fill_(blocked, float("-inf"))  # every row, in order: no gather / scatter
        return
    sub = logits.index_select(0, rows).masked_fill_(blocked, float("-inf"))
    logits.index_copy_(0, rows, sub)
