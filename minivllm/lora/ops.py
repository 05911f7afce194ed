"""Batched LoRA: add every token's adapter delta to a linear layer's output in one call.

    y[t] += B[s] @ (A[s] @ x[t])     s = slots[t]; nothing for s == -1 (the base model)

A: [S, R, in] and B: [S, out, R] are the layer's device slots (lora/layers.py; the adapter's
scaling is folded into B, a smaller rank is zero-padded). On a GPU this is two launches of the
Triton gather kernel (kernels/lora_bgmv.py: shrink, then expand into y); elsewhere the
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


def lora_delta_triton(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:
    """As the reference, for every token by its slot (graph-safe: no host sync). y must be
    contiguous in its last dim; the shrink's [T, R] intermediate is float32."""
    from minivllm.kernels.lora_bgmv import bgmv
    x = x.contiguous()
    mid = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    bgmv(x, a, slots, mid, accumulate=False)
    # rows of slot -1 were not written: B is read for none of them either
    bgmv(mid, b, slots, y, accumulate=True)
    return y
