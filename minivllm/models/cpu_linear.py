"""CPU fp32 linear layers on oneDNN-prepacked weights.

On the CPU, oneDNN with a weight reordered once into its blocked layout runs the linear shapes
of a batch 1.5-2x faster than `F.linear` (MKL on a plain row-major weight) from a few tokens up,
whatever the token count; for one or two tokens (single-stream decode, a matrix-vector product
bound by weight reads) `F.linear` is as fast or faster. `PackedLinear` keeps both: the original
weight (shared, e.g. with tied embeddings) and a packed copy, and picks by the number of rows.

Results differ from `F.linear` by fp32 summation order only (~1e-6 relative).

`pack_linears(model)` is called by the runner after loading when the model runs on the CPU in
float32; MINIVLLM_CPU_PACKED_LINEAR=0 turns it off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# Below this many rows F.linear is used (measured on a 2-core Xeon: oneDNN is slower at 1-2 rows
# and faster from 4, docs/perf.md W5).
MIN_PACKED_ROWS = 3
ENV_FLAG = "MINIVLLM_CPU_PACKED_LINEAR"


def packed_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and os.environ.get(ENV_FLAG, "1") != "0"


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, min_rows: int = MIN_PACKED_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: tied weights stay tied
        self.bias = linear.bias
        self.min_rows = min_rows
        # an opaque oneDNN tensor, not a parameter or buffer: derived data, rebuilt by packing again
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.min_rows * self.in_features:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, min_rows: int = MIN_PACKED_ROWS) -> int:
    """Replace every CPU float32 nn.Linear of `model` by a PackedLinear; returns how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.device.type == "cpu"
               and child.weight.dtype == torch.float32]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, min_rows))
    return len(targets)
