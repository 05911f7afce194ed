"""The quantized linear layer: parameters in the checkpoint's own names and layout, a method
that creates them, converts them after loading and computes the product.

Loading metadata on each parameter (read by models/weights.py, which fills fused layers shard by
shard: q/k/v into qkv_proj, gate/up into gate_up_proj):
    output_dim   the dimension that runs over output features (a shard is a slice of it)
    pack_factor  output features per element along output_dim (8 for int32 words packed along N)
    shared       the same tensor for every shard (g_idx): written whole, must agree between shards
    fill_scalar  a one-element checkpoint tensor fills the slice (per-tensor FP8 scales)
    optional     may be absent from the checkpoint
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from minivllm.quant.config import QuantConfig, is_ignored


class LinearMethod(Protocol):
    def create_weights(self, layer: QuantLinear) -> None: ...

    def init_dummy(self, layer: QuantLinear, gen: torch.Generator) -> None: ...

    def process_after_loading(self, layer: QuantLinear) -> None: ...

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor: ...


def new_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, *, output_dim: int | None = 0,
              pack_factor: int = 1, shared: bool = False, fill_scalar: bool = False, optional: bool = False) -> None:
    """Register a (frozen) checkpoint parameter with its loading metadata."""
    p = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    p.output_dim, p.pack_factor, p.shared = output_dim, pack_factor, shared
    p.fill_scalar, p.optional = fill_scalar, optional
    layer.register_parameter(name, p)


class QuantLinear(nn.Module):
    """y = x W^T + b with W stored quantized. `output_sizes`: the fused shards' widths (q, k, v or
    gate, up; one entry for a plain layer)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, quant: QuantConfig, name: str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, sum(output_sizes)
        self.output_sizes, self.quant, self.name = list(output_sizes), quant, name
        self.method = make_method(quant)
        self.method.create_weights(self)
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return f"{self.name}: in={self.in_features}, out={self.output_sizes}, {self.quant.layout}"


def make_method(quant: QuantConfig) -> LinearMethod:
    if quant.scheme == "fp8":
        from minivllm.quant.fp8 import Fp8Method
        return Fp8Method(quant)
    from minivllm.quant.w4a16 import W4A16Method
    return W4A16Method(quant)


def make_linear(in_features: int, output_sizes: list[int], bias: bool, quant: QuantConfig | None,
                hf_name: str) -> nn.Module:
    """nn.Linear, or a QuantLinear when the model is quantized and `hf_name` (the first shard's
    HF module name, e.g. model.layers.0.self_attn.q_proj) is not in its ignore list."""
    if quant is None or is_ignored(quant, hf_name):
        return nn.Linear(in_features, sum(output_sizes), bias=bias)
    return QuantLinear(in_features, output_sizes, bias, quant, hf_name)


def process_quantized_layers(model: nn.Module) -> int:
    """After loading: every QuantLinear converts its checkpoint tensors to the kernels' layout.
    On the CPU a W4A16 layer becomes a plain nn.Linear of its dequantized weight (the reference:
    the same numbers, and the CPU's packed linear kernels then apply). Returns how many layers."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, QuantLinear)]
    for parent, name, child in targets:
        child.method.process_after_loading(child)
        dense = getattr(child, "dense_weight", None)
        if dense is not None:
            # built on the meta device (no random init of a weight replaced at once)
            lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
            lin.weight = nn.Parameter(dense, requires_grad=False)
            if child.bias is not None:
                lin.bias = nn.Parameter(child.bias.data.to(dense.dtype), requires_grad=False)
            setattr(parent, name, lin)
    return len(targets)


def init_dummy_quantized(model: nn.Module, gen: torch.Generator) -> set[str]:
    """Random checkpoint tensors for every QuantLinear (benchmarks); returns the parameter names done."""
    done: set[str] = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            mod.method.init_dummy(mod, gen)
            done |= {f"{mod_name}.{n}" for n, _ in mod.named_parameters()}
    return done
