"""The CPU float32 forward of the decoder: the same math as `CausalLM.forward`, in fewer ops.

Why: single-stream decode on the CPU is a chain of matrix-vector products (~27 ms of weight
reads per token) with ~400 small ops in between. Every small op is cheap warm (1-15 us), but each
matmul streams megabytes of weights through the caches and evicts the interpreter's and the
dispatcher's code and data, so the first ops after a matmul run ~3x slower than in a
micro-benchmark (docs/perf.md, W5 run 6). What helps is fewer ops and less Python between
matmuls: no nn.Module `__call__`, the residual stream updated in place, the norm in plain
in-place ops, q and k rotated in four ops with cos/sin prepared once per step.

Every op here is bit-identical to the module path in float32 (tests/unit/test_cpu_fast_paths.py):
  residual   s = x + residual (in place; addition is commutative in IEEE arithmetic)
  rms_norm   y = s * rsqrt(sum(s * s) / H + eps) * w    (what F.rms_norm / HF's pow().mean() do)
  rotary     q viewed as [.., 2, D/2]: q * [cos|cos] + flip(q) * [-sin|sin]
             = [x1 cos - x2 sin | x2 cos + x1 sin]     (negation is exact)
  mlp        silu(gate) * up

With the compiled CPU kernels (kernels/cpu_kernels.py) the small ops go further: a layer is
four fused calls around its four matmuls (residual add + norm, rotary + K/V store, attention,
residual add + norm, SiLU-and-multiply). On the panel kernel (models/cpu_linear.py) the
SiLU-and-multiply runs inside the gate-up product (`PackedLinear.silu_mul_rows`). That path
equals the module path up to float32 rounding (the norm's sum of squares is added in another
order), not bit for bit.

`CpuForward(model, ops)` is installed by the runner on a CPU float32 model without q/k-norm
(`enable_cpu_forward`); MINIVLLM_CPU_FAST_FORWARD=0 keeps the module path.

Tensor and pipeline parallelism: it runs on a rank's shard as it is (local head and feature
counts come from the modules; o_proj's and down_proj's partial outputs are summed over the
tensor-parallel group before the residual add, the embedding is the vocabulary-parallel one), and
on a pipeline stage's layers (from the previous stage's hidden states; a stage before the last
returns them instead of normalizing).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.attention.metadata import AttentionMetadata
from minivllm.kernels.cpu_kernels import check_rope_store
from minivllm.models.layers import calibrate_kv_scales
from minivllm.models.llama import IntermediateTensors

ENV_FLAG = "MINIVLLM_CPU_FAST_FORWARD"


def cpu_forward_enabled() -> bool:
    return os.environ.get(ENV_FLAG, "1") != "0"


def supports_cpu_forward(model) -> bool:
    """The fast path covers the Llama-family decoder without q/k-norm or MoE layers, in float32
    on the CPU."""
    p = next(model.parameters())  # (a pipeline stage may have no LM head)
    return not model.cfg.qk_norm and model.cfg.moe is None and p.device.type == "cpu" and p.dtype == torch.float32


def rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] -> a new tensor, rms_norm(x) * weight; bit-identical to F.rms_norm in fp32.

    Five small ops on [T, 1] plus two on [T, H], instead of F.rms_norm's composite of eight."""
    rstd = torch.mul(x, x).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps).rsqrt_()  # [T, 1]
    return torch.mul(x, rstd).mul_(weight)


def rotary_tables(cos_sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_sin: [max_pos, D] = cat(cos, sin) -> (cos2, sin2), each [T, 1, 2, D/2]:
    cos2 = [cos | cos], sin2 = [-sin | sin], broadcast over the heads."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, D/2]
    t, half = cos.shape
    return (torch.stack([cos, cos], 1).view(t, 1, 2, half),
            torch.stack([-sin, sin], 1).view(t, 1, 2, half))


def rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (last dim contiguous) -> rotated, a new contiguous tensor.

    With x = [x1 | x2] viewed as [T, heads, 2, D/2]: flip(x) = [x2 | x1], so
    x * cos2 + flip(x) * sin2 = [x1 cos - x2 sin | x2 cos + x1 sin] (neox / HF rotate_half)."""
    t, heads, d = x.shape
    x4 = x.view(t, heads, 2, d // 2)
    swapped = x4.flip(-2).mul_(sin2)
    return torch.mul(x4, cos2).add_(swapped).view(t, heads, d)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parameters and callables, looked up once (not per token)."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    qkv: Callable[[torch.Tensor], torch.Tensor]  # the layer modules' bound forward methods
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    attn: torch.nn.Module  # k_cache / v_cache are read from it per step (set after loading)
    # x -> silu(gate) * up in one pass (the panel kernel's gate-up epilogue); None: gate_up, then
    # the activation
    gate_up_act: Callable[[torch.Tensor], torch.Tensor] | None = None


class CpuForward:
    """`forward(input_ids, positions, meta)` with the result of `CausalLM.forward`.

    ops: the compiled CPU kernels' op namespace (kernels/cpu_kernels.load()), or None for the
    plain-PyTorch ops (bit-identical to the module path)."""

    def __init__(self, model, ops=None) -> None:
        assert supports_cpu_forward(model)
        self.ops = ops
        cfg = model.cfg
        self.eps = cfg.rms_norm_eps
        first = model.layers[0].self_attn
        # this rank's heads and MLP features (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, cfg.head_dim
        self.qk_width = (self.num_heads + self.num_kv_heads) * self.head_dim  # q and k columns of qkv
        self.inter = model.plan.intermediate_size
        self.tp = model.tp  # sums row-parallel outputs; None on a single rank
        # first stage: a plain embedding's weight (F.embedding), or the vocabulary-parallel module
        embed = model.embed_tokens
        self.embed = embed.weight if type(embed) is torch.nn.Embedding else None
        self.embed_module = embed
        self.final_norm = model.norm.weight if model.norm is not None else None  # None before the last stage
        self.cos_sin, self.backend, self.scale = first.rotary.cos_sin, first.backend, first.scale
        # plain methods, not module __call__: nn.Linear.forward or PackedLinear.forward (minivllm's
        # panel kernel, or F.linear / the packed oneDNN weight by row count)
        self.layers = [_Layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                              layer.self_attn.qkv_proj.forward, layer.self_attn.o_proj.forward,
                              layer.mlp.gate_up_proj.forward, layer.mlp.down_proj.forward, layer.self_attn,
                              _fused_gate_up_act(layer.mlp.gate_up_proj) if ops is not None else None)
                       for layer in model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                output_rows: torch.Tensor | None = None, num_layers: int | None = None,
                intermediate=None):
        """input_ids, positions: [T] -> final-normed hidden states [T, H] (a new tensor), or of
        the token rows output_rows only ([R] int64) -> [R, H]; through the first num_layers
        layers only when given. A later pipeline stage starts from `intermediate` (owned tensors:
        updated in place); a stage before the last returns IntermediateTensors."""
        if intermediate is None:  # [T, H], owned: updated in place below
            residual = F.embedding(input_ids, self.embed) if self.embed is not None else self.embed_module(input_ids)
            hidden = None
        else:
            residual, hidden = intermediate.residual, intermediate.hidden
        if self.final_norm is None:
            output_rows = None  # every row goes on to the next stage
        layers = self.layers[:num_layers]
        if self.ops is not None:
            return self._forward_fused(residual, hidden, positions, meta, output_rows, layers)
        cos2, sin2 = rotary_tables(self.cos_sin, positions)
        for layer in layers:
            hidden = self._layer(layer, hidden, residual, cos2, sin2, meta)
        if self.final_norm is None:
            return IntermediateTensors(hidden, residual)
        out = rms_norm_(residual.add_(hidden), self.final_norm, self.eps)
        return out if output_rows is None else out[output_rows]

    def _layer(self, p: _Layer, hidden: torch.Tensor | None, residual: torch.Tensor, cos2: torch.Tensor,
               sin2: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One decoder layer: adds `hidden` (None before the first layer) into `residual` in place
        (twice: before attention and before the MLP) and returns the MLP output [T, H]."""
        t = residual.shape[0]
        if hidden is not None:
            residual.add_(hidden)
        qkv = p.qkv(rms_norm_(residual, p.input_norm, self.eps))  # [T, (Hq + 2 Hk) D]
        qk = rotate(qkv[:, :self.qk_width].view(t, -1, self.head_dim), cos2, sin2)  # [T, Hq + Hk, D]
        k, v = qk[:, self.num_heads:], qkv[:, self.qk_width:].view(t, self.num_kv_heads, self.head_dim)
        attn = p.attn
        if attn.calibrate_kv:
            calibrate_kv_scales(attn, k, v)
        self.backend.store_kv(k, v, attn.k_cache, attn.v_cache, meta.slot_mapping, attn.k_scale, attn.v_scale)
        o = self.backend.attend(qk[:, :self.num_heads], attn.k_cache, attn.v_cache, meta, self.scale,
                                attn.k_scale, attn.v_scale)
        attn_out = p.o(o.reshape(t, -1))
        residual.add_(attn_out if self.tp is None else self.tp.all_reduce(attn_out))
        gate_up = p.gate_up(rms_norm_(residual, p.post_norm, self.eps))  # [T, 2 I]: gate | up
        out = p.down(F.silu(gate_up[:, :self.inter]).mul_(gate_up[:, self.inter:]))
        return out if self.tp is None else self.tp.all_reduce(out)


    def _forward_fused(self, residual: torch.Tensor, hidden: torch.Tensor | None, positions: torch.Tensor,
                       meta: AttentionMetadata, output_rows: torch.Tensor | None, layers: list[_Layer]):
        """The same layers through the compiled kernels: four fused calls a layer. With
        output_rows, the last layer runs attention, o-proj and MLP for those rows only (its K/V
        are still written for every token): W5's prompt tokens skip ~1/30 of their prefill."""
        ops, eps, t = self.ops, self.eps, residual.shape[0]
        positions = positions.contiguous()
        first = self.layers[0].attn
        # the kernels index with these: checked once per step, in Python (kernels/cpu_kernels.py)
        check_rope_store(positions, meta.slot_mapping, self.cos_sin.shape[0],
                         first.k_cache.shape[0] * first.k_cache.shape[1])
        last = len(layers) - 1
        for i, p in enumerate(layers):
            attn = p.attn
            qkv = p.qkv(ops.add_rms_norm(residual, hidden, p.input_norm, eps))  # [T, (Hq + 2 Hk) D]
            # q and k rotated in place, k and v written to their cache slots
            ops.rope_store_kv(qkv, positions, self.cos_sin, self.num_heads, self.num_kv_heads, attn.k_cache,
                              attn.v_cache, meta.slot_mapping)
            q = qkv.view(t, -1, self.head_dim)[:, :self.num_heads]  # rows strided, heads contiguous
            if i == last and output_rows is not None:
                # from here on only the rows asked for: residual already holds this layer's input
                o = self._attend_rows(q, attn, meta, output_rows)
                residual = residual.index_select(0, output_rows)
            else:
                o = self.backend.attend(q, attn.k_cache, attn.v_cache, meta, self.scale)
            # the width is spelled out: with no rows to output (a step of prompt chunks that
            # sample nothing) o is empty and reshape could not infer a -1
            attn_out = p.o(o.reshape(o.shape[0], self.num_heads * self.head_dim))
            if self.tp is not None:
                self.tp.all_reduce(attn_out)
            x = ops.add_rms_norm(residual, attn_out, p.post_norm, eps)
            hidden = p.down(p.gate_up_act(x) if p.gate_up_act is not None else ops.silu_mul(p.gate_up(x)))
            if self.tp is not None:
                self.tp.all_reduce(hidden)
        if self.final_norm is None:
            return IntermediateTensors(hidden, residual)
        return ops.add_rms_norm(residual, hidden, self.final_norm, eps)

    def _attend_rows(self, q: torch.Tensor, attn, meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        """Attention of the query rows `rows` of q [T, Hq, D] -> [R, Hq, D]: only those rows where
        the backend can (the CPU kernel serving every token of the step), else all, then the rows."""
        o = self.backend.attend_rows(q, attn.k_cache, attn.v_cache, meta, self.scale, rows)
        if o is None:
            o = self.backend.attend(q, attn.k_cache, attn.v_cache, meta, self.scale).index_select(0, rows)
        return o


def _fused_gate_up_act(gate_up) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The gate_up layer's one-pass silu(gate) * up where it has one (PackedLinear on the panel
    kernel: W5 prefill's SiLU-and-multiply, 0.11 s, and the [T, 2 I] round trip go away)."""
    return gate_up.silu_mul_rows if getattr(gate_up, "fuses_silu_mul", False) else None


def enable_cpu_forward(model, ops=None) -> bool:
    """Route `model.forward` through CpuForward when supported and not switched off; returns
    whether it did. Call after any change of the model's linear modules (pack_linears).
    ops: the compiled CPU kernels (kernels/cpu_kernels.load()), or None for PyTorch ops."""
    if not (cpu_forward_enabled() and supports_cpu_forward(model)):
        return False
    model.cpu_forward = CpuForward(model, ops)
    return True
