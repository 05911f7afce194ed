"""LoRA layers: a decoder's linear layers with device slots for adapters.

`LoRALinear` wraps a model linear (nn.Linear, the CPU's PackedLinear or a QuantLinear) that may
fuse several adapted modules (q/k/v in one qkv_proj, gate/up in one gate_up_proj). Its slots:

    lora_a: [max_loras, M * max_rank, in]     the M modules' A stacked (rank zero-padded)
    lora_b: [max_loras, sum(out), M * max_rank]  block-diagonal: module m's B * scaling at
                                              rows of its output slice, columns m * max_rank ...

so one shrink and one expand per layer serve the fused modules. Which slot each token uses is
the step's `LoRAStepState`, set by the runner (lora/manager.py) before the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from minivllm.lora.ops import lora_delta_reference, lora_delta_triton


@dataclass
class LoRAStepState:
    """The step's adapter assignment, shared by every LoRALinear of a model.

    On the GPU the step's token rows grouped by slot (`slot_segments`): order [max tokens],
    start and count [max_loras], int32 persistent buffers so CUDA graphs read them at fixed
    addresses (graph padding rows are in no segment); groups: (slot, token indices) per slot
    present (the CPU reference); active: whether layers add deltas this step (always on the
    GPU, where graphs capture the kernels; on the CPU only for steps with adapters)."""

    order: torch.Tensor
    start: torch.Tensor
    count: torch.Tensor
    use_triton: bool
    active: bool = False
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def apply(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            return lora_delta_triton(x, y, a, b, (self.order, self.start, self.count))
        return lora_delta_reference(x, y, a, b, self.groups)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, modules: tuple[str, ...], out_sizes: tuple[int, ...], in_features: int,
                 state: LoRAStepState, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.modules_ = modules
        self.out_sizes = out_sizes
        self.max_rank = max_rank
        self.state = state
        m = len(modules)
        self.register_buffer("lora_a", torch.zeros(max_loras, m * max_rank, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, sum(out_sizes), m * max_rank, dtype=dtype,
                                                   device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.state.active:
            return y
        return self.state.apply(x, y, self.lora_a, self.lora_b)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill a slot: weights maps module name -> (A [r, in], B * scaling [out, r]); modules the
        adapter does not adapt stay zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        row = 0
        for i, (name, out) in enumerate(zip(self.modules_, self.out_sizes)):
            if name in weights:
                a, b = weights[name]
                r, col = a.shape[0], i * self.max_rank
                self.lora_a[slot, col:col + r].copy_(a)
                self.lora_b[slot, row:row + out, col:col + r].copy_(b)
            row += out


# (attribute path in a decoder layer, adapted modules, their output sizes from the arch)
def _targets(arch) -> list[tuple[str, str, tuple[str, ...], tuple[int, ...], int]]:
    q, kv, h, i = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size, \
        arch.intermediate_size
    return [("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj"), (q, kv, kv), h),
            ("self_attn", "o_proj", ("o_proj",), (h,), q),
            ("mlp", "gate_up_proj", ("gate_proj", "up_proj"), (i, i), h),
            ("mlp", "down_proj", ("down_proj",), (h,), i)]


def wrap_model(model: nn.Module, arch, state: LoRAStepState, max_loras: int, max_rank: int,
               dtype: torch.dtype, device: torch.device) -> dict[tuple[int, str], LoRALinear]:
    """Replace every adaptable linear of the decoder layers by a LoRALinear around it. Returns
    (layer index, module name) -> the LoRALinear holding that module (fused modules share one)."""
    out: dict[tuple[int, str], LoRALinear] = {}
    for idx, layer in enumerate(model.layers):
        for parent_name, attr, modules, sizes, in_features in _targets(arch):
            parent = getattr(layer, parent_name)
            base = getattr(parent, attr, None)
            if base is None:  # a sparse MoE layer's MLP has no dense gate_up / down
                continue
            wrapped = LoRALinear(base, modules, sizes, in_features, state, max_loras, max_rank, dtype, device)
            setattr(parent, attr, wrapped)
            for m in modules:
                out[(idx, m)] = wrapped
    return out
