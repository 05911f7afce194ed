"""FP8 activations quantized where they are made: RMSNorm (+ residual add) and SwiGLU write the
e4m3 rows and per-token scales that the next FP8 linear reads (kernels/fp8_gemm.py), instead of a
bf16 row that `_quant_rows_kernel` reads back and quantizes in a launch of its own.

    norm -> [T, H] e4m3 + [T] scales        (fused_ops._rms_norm_kernel with QUANT_FP8)
    silu(gate) * up -> [T, I] e4m3 + [T]    (_silu_mul_quant_kernel: one program per row, two passes)

Bits: each kernel first rounds the value to the dtype the unfused op would have stored, then
quantizes it with the quantizer's own arithmetic (s = max(max|x| / 448, MIN_SCALE); q =
clamp(x / s) in e4m3, both divisions IEEE-rounded). SwiGLU rows are the unfused pair's bytes.
A norm's row sum may compile to another float32 order than in the plain norm kernel: on an H100
(lease 18) float16 rows of 12,288 then differed in a few codes by one rounding step; 4,096-wide
rows and every bfloat16 row were the same bytes. The model wires them in at load
time (`enable_fused_activation_quant`); MINIVLLM_FP8_FUSED_QUANT=0 keeps the separate launches.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from minivllm.kernels.fp8_gemm import Fp8Rows
from minivllm.kernels.fused_ops import (_rms_norm_kernel, fused_add_rms_norm_torch, norm_warps, rms_norm_torch,
                                        silu_and_mul_torch)
from minivllm.kernels.pdl import enter_after_previous, pdl_args
from minivllm.quant.config import FP8_E4M3_MAX
from minivllm.quant.fp8 import FP8, MIN_SCALE, quantize_rows

FUSED_QUANT = os.environ.get("MINIVLLM_FP8_FUSED_QUANT", "1") != "0"


@triton.jit
def _silu_mul_chunk(row, c, I):
    """Columns c of a = silu(gate).to(dtype) * up, rounded to the dtype as _silu_and_mul_kernel
    stores it, in float32 (0 past I)."""
    dt = row.dtype.element_ty
    g = tl.load(row + c, mask=c < I, other=0.0).to(tl.float32)
    u = tl.load(row + I + c, mask=c < I, other=0.0)
    return ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u.to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(
    in_ptr,  # [T, 2I]: gate | up, last dim contiguous
    q_ptr,  # [T, I] e4m3
    s_ptr,  # [T] float32
    stride_it, stride_qt, I,
    BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_S: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    """Row t: pass 1 takes max|a| (_silu_mul_chunk), pass 2 recomputes a (the row is in L2)
    and stores clamp(a / s) in e4m3."""
    enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    row = in_ptr + t * stride_it
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, I, BLOCK):
        amax = tl.maximum(amax, tl.abs(_silu_mul_chunk(row, c0 + tl.arange(0, BLOCK), I)))
    s = tl.maximum(tl.div_rn(tl.max(amax, 0), FP8_MAX), MIN_S)
    tl.store(s_ptr + t, s)
    for c0 in range(0, I, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        q = tl.clamp(tl.div_rn(_silu_mul_chunk(row, c, I), s), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + t * stride_qt + c, q.to(q_ptr.dtype.element_ty), mask=c < I)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[Fp8Rows, torch.Tensor | None]:
    """x [T, H] (+ residual) -> (the normed rows quantized per token, x + residual or None):
    fused_ops.fused_add_rms_norm / rms_norm followed by the FP8 linear's quantizer, one launch.
    Off CUDA: the same two steps in torch (the reference)."""
    if not x.is_cuda:
        if residual is None:
            return Fp8Rows(*quantize_rows(rms_norm_torch(x, weight, eps)), x.dtype), None
        normed, res_out = fused_add_rms_norm_torch(x, residual, weight, eps)
        return Fp8Rows(*quantize_rows(normed), x.dtype), res_out
    return rms_norm_fp8_triton(x, weight, eps, residual)


def rms_norm_fp8_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None = None) -> tuple[Fp8Rows, torch.Tensor | None]:
    """Kernel path of `rms_norm_fp8` (also on CPU tensors under TRITON_INTERPRET=1)."""
    num_tokens, hidden = x.shape
    assert weight.dtype == x.dtype and x.stride(-1) == 1 and weight.is_contiguous(), (weight.dtype, x.dtype)
    q = torch.empty(num_tokens, hidden, dtype=FP8, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    res_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        res_out = torch.empty_like(x)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens, 1)](
            x, residual if residual is not None else x, weight, q, res_out if res_out is not None else x,
            x.stride(0), 0, residual.stride(0) if residual is not None else 0, q.stride(0), 0,
            res_out.stride(0) if res_out is not None else 0, 1, eps,
            H=hidden, BLOCK=block, ROWS=1, HAS_RESIDUAL=residual is not None, QUANT_FP8=True, scale_ptr=scale,
            FP8_MAX=FP8_E4M3_MAX, MIN_SCALE=MIN_SCALE, num_warps=norm_warps(block), **pdl_args(x),
        )
    return Fp8Rows(q, scale, x.dtype), res_out


def silu_and_mul_fp8(gate_up: torch.Tensor) -> Fp8Rows:
    """gate_up [T, 2I] -> silu(gate) * up quantized per token: fused_ops.silu_and_mul followed by
    the FP8 linear's quantizer, one launch. Off CUDA: the same two steps in torch."""
    if not gate_up.is_cuda:
        return Fp8Rows(*quantize_rows(silu_and_mul_torch(gate_up)), gate_up.dtype)
    return silu_and_mul_fp8_triton(gate_up)


def silu_and_mul_fp8_triton(gate_up: torch.Tensor) -> Fp8Rows:
    """Kernel path of `silu_and_mul_fp8` (also on CPU tensors under TRITON_INTERPRET=1)."""
    num_tokens, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(-1) == 1, (gate_up.shape, gate_up.stride())
    inter = two_i // 2
    q = torch.empty(num_tokens, inter, dtype=FP8, device=gate_up.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=gate_up.device)
    if num_tokens:
        block = min(triton.next_power_of_2(inter), 4096)
        _silu_mul_quant_kernel[(num_tokens,)](gate_up, q, scale, gate_up.stride(0), q.stride(0), inter,
                                              BLOCK=block, FP8_MAX=FP8_E4M3_MAX, MIN_S=MIN_SCALE,
                                              num_warps=max(1, min(8, block // 512)), **pdl_args(gate_up))
    return Fp8Rows(q, scale, gate_up.dtype)


def _is_fp8_linear(module) -> bool:
    from minivllm.quant.fp8 import Fp8Method
    from minivllm.quant.layer import QuantLinear
    return type(module) is QuantLinear and isinstance(module.method, Fp8Method) and hasattr(module, "weight_fp8")


def enable_fused_activation_quant(layers, on_cpu: bool = False) -> int:
    """Point every norm and SwiGLU whose only consumer is an FP8 linear (not wrapped, e.g. by
    LoRA) at the fused quantizing kernels. Dense decoder layers only (a MoE block's input also
    feeds its router). CUDA layers only unless on_cpu (tests: the torch stand-ins then run).
    Returns how many activations now arrive quantized."""
    from minivllm.models.layers import MLP
    if not FUSED_QUANT:
        return 0
    count = 0
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or not isinstance(mlp, MLP):
            continue
        for norm, consumer in ((layer.input_layernorm, attn.qkv_proj), (layer.post_attention_layernorm, mlp.gate_up_proj)):
            if _is_fp8_linear(consumer) and (norm.weight.is_cuda or on_cpu):
                norm.fp8_out = True
                count += 1
        if _is_fp8_linear(mlp.down_proj) and (mlp.down_proj.weight_fp8.is_cuda or on_cpu):
            mlp.fp8_act = True
            count += 1
    return count
