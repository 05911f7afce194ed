"""Layers shared by every architecture: norms, rotary embedding, attention, MLP."""

from __future__ import annotations

import math

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.metadata import AttentionMetadata
from minivllm.distributed.communication import TensorParallelGroup
from minivllm.kernels.fused_ops import apply_rotary, fused_add_rms_norm, qk_norm_rotary, rms_norm, silu_and_mul
from minivllm.quant.config import QuantConfig
from minivllm.quant.layer import make_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # set at load time when the only consumer is an FP8 linear: the output comes quantized
        # per token (kernels/fp8_act.py: Fp8Rows instead of a tensor)
        self.fp8_out = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`: returns (norm(x + residual), x + residual), the fused pre-norm step.

        Triton kernels on CUDA, the same torch math as Hugging Face elsewhere (kernels/fused_ops.py)."""
        if self.fp8_out:
            from minivllm.kernels.fp8_act import rms_norm_fp8
            rows, residual_out = rms_norm_fp8(x, self.weight, self.eps, residual)
            return rows if residual is None else (rows, residual_out)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF's rotate_half layout) with a precomputed cos/sin cache."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        # computed in fp32 exactly as Hugging Face does, so fp32 outputs match token for token
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3":
                raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3)")
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # [max_pos, head_dim / 2]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], -1), persistent=False)
        self._step_cos_sin: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [T, Hq, D], k: [T, Hk, D]; on CUDA rotated in place: use the returned tensors
        return apply_rotary(positions, q, k, self.cos_sin)

    def rotate_qk_cpu(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """CPU float32: q and k heads side by side, qk: [T, Hq + Hk, D] -> rotated, a new tensor.

        The same math as apply_rotary's torch path (bit-identical) in 7 ops for q and k together;
        cos/sin are looked up once per step (every layer shares this module and the positions
        tensor of the step)."""
        if self._step_cos_sin is None or self._step_cos_sin[0] is not positions:
            cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
            self._step_cos_sin = (positions, cos, sin)
        _, cos, sin = self._step_cos_sin
        x1, x2 = qk.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    """QKV projection (one matmul), optional q/k RMSNorm, rotary, paged attention, output projection.

    quant / prefix: the model's quantization (None: plain nn.Linear) and this layer's HF name
    (model.layers.N.self_attn), which the quantization's ignore list is matched against.
    Under tensor parallelism num_heads / num_kv_heads are this rank's (distributed/sharding.py)
    and tp sums o_proj's partial outputs over the ranks (None: a single rank)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 qk_norm: bool, eps: float, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant: QuantConfig | None = None, prefix: str = "", tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = make_linear(hidden, [self.q_size, self.kv_size, self.kv_size], bias, quant, f"{prefix}.q_proj")
        self.o_proj = make_linear(self.q_size, [hidden], False, quant, f"{prefix}.o_proj")
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.scale = head_dim ** -0.5
        # set by the runner once the KV cache is allocated: [num_blocks, block_size, Hk, D]
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # an FP8 cache holds K / k_scale and V / v_scale (per-tensor, float32 [1]): from the
        # checkpoint (models/weights.py), else 1.0; unused by a cache in the model's dtype
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        # calculate_kv_scales: the runner sets this for the first real step; the scales then come
        # from that step's K and V (calibrate_kv_scales) before anything is stored
        self.calibrate_kv = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = self.o_proj(self.attend(positions, x, meta))
        return out if self.tp is None else self.tp.all_reduce(out)

    def attend(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Everything before o_proj: x [T, hidden] -> the heads' outputs [T, q_size]."""
        return self.attend_qkv(positions, self.qkv_proj(x), meta)

    def attend_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """From the projected qkv [T, q_size + 2 kv_size]: rotary, K/V store, attention -> [T, q_size]."""
        t = qkv.shape[0]
        if qkv.device.type == "cpu" and qkv.dtype == torch.float32 and self.q_norm is None:
            # CPU fast path: rotate q and k in one go (fewer small ops per layer, same numbers)
            qk = self.rotary.rotate_qk_cpu(positions, qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim))
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            rotated = self._rotate_and_store(positions, q, k, v, meta)
            if rotated is not None:  # one kernel rotated q and stored the rotated K with V
                q, k = rotated, None
            elif self.q_norm is not None:  # (one launch on the GPU; the three ops elsewhere)
                q, k = qk_norm_rotary(positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                      self.rotary.cos_sin)
            else:
                q, k = self.rotary(positions, q, k)
        if k is not None:  # K/V not stored yet
            if self.calibrate_kv:
                calibrate_kv_scales(self, k, v)
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return self._attend_rotated(q, meta)

    def attend_stored(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """attend_qkv for a qkv whose q is already rotated and whose K/V are already in the cache
        (a chained W4 layer tail did both, kernels/w4_layer_tail.RopeTarget): attention -> [T, q_size]."""
        return self._attend_rotated(qkv[:, :self.q_size].view(qkv.shape[0], self.num_heads, self.head_dim), meta)

    def _attend_rotated(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The rotated q [T, heads, D] over the cache (K/V stored) -> [T, q_size]."""
        o = self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale, self.k_scale, self.v_scale)
        return o.reshape(q.shape[0], self.q_size)

    def _rotate_and_store(self, positions, q, k, v, meta) -> torch.Tensor | None:
        """The backend's one-kernel rotary (after the q/k norm) and K/V store where it has one
        (Triton on CUDA): -> the rotated q; None where it does not apply, or while this step
        calibrates the FP8 scales (they come from the rotated K before anything is stored)."""
        fused = getattr(self.backend, "rotary_store_kv", None)
        if fused is None or self.calibrate_kv:
            return None
        norms = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        return fused(positions, q, k, v, self.rotary.cos_sin, self.k_cache, self.v_cache, meta.slot_mapping,
                     self.k_scale, self.v_scale, norms, self.q_norm.eps if norms else 0.0)


# calculate_kv_scales: scale = max|x| / range, so the calibration step's largest K sits at 200 and
# V at 100 of e4m3's 448 (vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT: headroom for later tokens)
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0


def calibrate_kv_scales(attn: Attention, k: torch.Tensor, v: torch.Tensor) -> None:
    """Per-tensor FP8 KV scales from this step's keys and values (once: clears attn.calibrate_kv)."""
    attn.k_scale.copy_((k.abs().amax().float() / K_SCALE_RANGE).clamp(min=1e-6).reshape(1))
    attn.v_scale.copy_((v.abs().amax().float() / V_SCALE_RANGE).clamp(min=1e-6).reshape(1))
    attn.calibrate_kv = False


class MLP(nn.Module):
    """SwiGLU: gate and up projections as one matmul, then down. Under tensor parallelism
    `intermediate` is this rank's share and tp sums down_proj's partial outputs."""

    def __init__(self, hidden: int, intermediate: int, quant: QuantConfig | None = None, prefix: str = "",
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = make_linear(hidden, [intermediate, intermediate], False, quant, f"{prefix}.gate_proj")
        self.down_proj = make_linear(intermediate, [hidden], False, quant, f"{prefix}.down_proj")
        self.fp8_act = False  # set at load time for an FP8 down_proj: SwiGLU quantizes (kernels/fp8_act.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fp8_act:
            from minivllm.kernels.fp8_act import silu_and_mul_fp8
            out = self.down_proj(silu_and_mul_fp8(gate_up))
        else:
            out = self.down_proj(silu_and_mul(gate_up))  # silu(gate) * up
        return out if self.tp is None else self.tp.all_reduce(out)
