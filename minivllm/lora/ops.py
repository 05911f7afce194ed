"""Batched LoRA: add every token's adapter delta to a linear layer's output in one call.

    y[t] += B[s] @ (A[s] @ x[t])     s = slots[t]; nothing for s == -1 (the base model)

A: [S, R, in] and B: [S, out, R] are the layer's device slots (lora/layers.py; the adapter's
scaling is folded into B, a smaller rank is zero-padded). On a GPU this is two launches of the
Triton segmented kernel (kernels/lora_sgmv.py: shrink, then expand into y) over the step's
tokens grouped by slot (`slot_segments`, computed once a step on the host); elsewhere the
reference below, one pair of matmuls per adapter present in the step (`groups`).
"""

from __future__ import annotations

import torch


def lora_delta_reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         groups: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """x: [T, in], y: [T, out] (updated in place and returned); groups: (slot, token indices)
    for each slot present in the step."""
    for slot, idx in groups:
        xs = x.index_select(0, idx)
        delta = (xs @ a[slot].t().to(x.dtype)) @ b[slot].t().to(x.dtype)  # [n, out]
        y.index_add_(0, idx, delta.to(y.dtype))
    return y


def slot_segments(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's token rows grouped by adapter slot, for the segmented kernel: (order, start,
    count), int32 on slots' device, with order[start[s] : start[s] + count[s]] the rows of slot s
    in ascending order. slots: [T] int, -1 for a row without an adapter (in no segment)."""
    slots = slots.to(torch.int64)
    with_adapter = (slots >= 0).nonzero().flatten()
    order = with_adapter[torch.argsort(slots[with_adapter], stable=True)]
    count = torch.bincount(slots[with_adapter], minlength=num_slots)[:num_slots]
    start = torch.cumsum(count, 0) - count
    order = torch.cat([order, order.new_zeros(slots.shape[0] - order.shape[0])])  # unused tail
    return order.to(torch.int32), start.to(torch.int32), count.to(torch.int32)


def lora_delta_triton(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """As the reference, for the rows of each slot's segment (`slot_segments`; graph-safe: no
    host sync). y must be contiguous in its last dim; the shrink's [T, R] intermediate is float32."""
    from minivllm.kernels.lora_sgmv import sgmv
    x = x.contiguous()
    order, start, count = segments
    mid = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    sgmv(x, a, order, start, count, mid, accumulate=False)
    # rows in no segment were not written: the expand reads none of them either
    sgmv(mid, b, order, start, count, y, accumulate=True)
    return y
