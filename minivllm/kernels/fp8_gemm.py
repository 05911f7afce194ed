"""FP8 linear on GPUs with FP8 (compute capability >= 8.9): activations quantized per token by a
Triton kernel, the product by torch._scaled_mm (cuBLASLt FP8 GEMM) with row-wise scales.

    x [M, K] -> x_q [M, K] e4m3, s_x [M, 1]      (_quant_rows_kernel: one program per row)
    y = _scaled_mm(x_q, w_q.T, scale_a=s_x, scale_b=s_w [1, N], out_dtype=x.dtype, use_fast_accum=True)

w_q [N, K] row-major is exactly the column-major [K, N] operand _scaled_mm wants. Fast
accumulation (the tensor cores' own FP8 accumulator, not promoted to float32 every few MMAs) is
what vLLM's CUTLASS FP8 kernels use too; MINIVLLM_FP8_FAST_ACCUM=0 turns it off. The reference
is quant/fp8.py: quantize_rows, fp8_linear_reference.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import enter_after_previous, pdl_args
from minivllm.quant.fp8 import FP8, MIN_SCALE
from minivllm.quant.config import FP8_E4M3_MAX

FAST_ACCUM = os.environ.get("MINIVLLM_FP8_FAST_ACCUM", "1") != "0"


class Fp8Rows(NamedTuple):
    """Activations already quantized per token (kernels/fp8_act.py): what `fp8_linear` takes in
    place of a bf16/fp16 tensor, skipping its own quantizer launch."""

    q: torch.Tensor  # [T, K] e4m3
    scale: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype  # the activations' dtype: the linear's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, MIN_S: tl.constexpr,
                       FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Row m: s = max(max|x[m]| / 448, MIN_S); q[m] = clamp(x[m] / s) in e4m3."""
    enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
    m = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    s = tl.maximum(tl.div_rn(tl.max(amax, 0), FP8_MAX), MIN_S)
    tl.store(s_ptr + m, s)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, s), -FP8_MAX, FP8_MAX)  # IEEE division: as torch, and the fused kernels
        tl.store(q_ptr + m * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=k < K)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (x_q [M, K] e4m3, scales [M, 1] float32)."""
    m, k = x.shape
    assert x.stride(1) == 1, x.stride()
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = min(2048, triton.next_power_of_2(k))
        _quant_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), MIN_S=MIN_SCALE, FP8_MAX=FP8_E4M3_MAX,
                                 BLOCK_K=block, num_warps=4 if block >= 1024 else 2, **pdl_args(x))
    return q, s


def fp8_linear(x: torch.Tensor | Fp8Rows, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16, or Fp8Rows [T, K]) -> [..., N]: per-token FP8 quantization (unless
    x comes quantized), then the FP8 GEMM."""
    if isinstance(x, Fp8Rows):
        lead, x_q, x_scale, dtype = x.q.shape[:-1], x.q, x.scale, x.dtype
    else:
        lead, k, dtype = x.shape[:-1], x.shape[-1], x.dtype
        rows = x.reshape(-1, k)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        x_q, x_scale = quantize_rows_triton(rows)
    # row-wise scales come with a bfloat16 output only (cuBLASLt / CUTLASS); other dtypes convert after
    y = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16,
                         use_fast_accum=FAST_ACCUM)
    if y.dtype != dtype:
        y = y.to(dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, w_q.shape[0])
