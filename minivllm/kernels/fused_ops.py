"""Small fused Triton kernels for the per-token layers: RMSNorm (+ residual add), rotary, SwiGLU.

Each public wrapper (`rms_norm`, `fused_add_rms_norm`, `apply_rotary`, `silu_and_mul`) runs the
Triton kernel when its tensors are on CUDA and Triton is importable, and otherwise the plain
torch math (`*_torch`), which is exactly the math the layers always had: CPU results are
bit-identical to before. The `*_triton` launchers take the kernel path unconditionally (the
interpreter tests call them on CPU tensors under TRITON_INTERPRET=1).

The kernels round where torch rounds, so on the GPU they match the torch ops up to fp32
reduction order / FMA contraction (at most one ulp of the output dtype, and rarely):
  rms_norm      y = (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype) * weight       (HF order)
  fused add     s = (x + residual) in dtype; y = rms_norm(s); returns (y, s)
  rotary        neox layout, x = [x1 | x2]: [x1 cos - x2 sin | x2 cos + x1 sin] in fp32, then dtype
  silu_and_mul  [gate | up] -> silu(gate).to(dtype) * up

Layout: one program per token row (the norms: a row is [H], or for q/k-norm a few heads of
[D] each); the last dim must be contiguous, the row (token) and head strides are free, so q/k
views of the fused qkv matmul output are processed without a copy.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: every wrapper takes the torch path
    triton = tl = None

from minivllm.kernels.pdl import enter_after_previous, pdl_args  # noqa: E402 (needs the triton guard above)

MAX_NORM_BLOCK = 32768  # widest row the norm kernel keeps in registers; wider rows use torch


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


def _on_triton(*tensors: torch.Tensor) -> bool:
    return triton is not None and all(t.is_cuda for t in tensors)


# ------------------------------------------------------------------ torch math (the reference)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32:
        # one Python-level call instead of eight (inside, torch's CPU rms_norm is still a
        # composite of ~8 aten ops): bit-identical to the math below in fp32
        # (tests/unit/test_cpu_fast_paths.py), ~2x faster on decode-sized rows
        return nn.functional.rms_norm(x, weight.shape, weight, eps)
    orig_dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(orig_dtype) * weight


def fused_add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return rms_norm_torch(x, weight, eps), x


def apply_rotary_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


# ------------------------------------------------------------------ public wrappers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] or [T, heads, H] (e.g. q/k-norm on a strided q view) -> new tensor, x's shape.

    The output dtype is torch's promotion of x and weight (x's dtype when they agree)."""
    if _on_triton(x, weight) and _norm_supported(x, weight):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (rms_norm(x + residual), x + residual), in one pass on the GPU.

    With inplace=True (GPU path only) the results are written into x and residual themselves
    and those two tensors are returned: use it only where the caller no longer needs the inputs.
    The default allocates two new tensors (same bytes moved; only memory footprint differs)."""
    if (_on_triton(x, residual, weight) and _norm_supported(x, weight) and x.dim() == 2
            and residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
            and x.data_ptr() != residual.data_ptr()):
        return fused_add_rms_norm_triton(x, residual, weight, eps, inplace=inplace)
    return fused_add_rms_norm_torch(x, residual, weight, eps)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int; q: [T, Hq, D]; k: [T, Hk, D]; cos_sin: [max_pos, D] fp32 = cat(cos, sin).

    Returns the rotated (q, k). On the GPU q and k are rotated IN PLACE (one launch for both)
    and returned; on the CPU new tensors are returned. Either way: use the return values and
    treat the inputs as consumed. Positions must be < max_pos (not checked on the GPU)."""
    if rotary_kernel_takes(positions, q, k, cos_sin):
        return apply_rotary_triton(positions, q, k, cos_sin)
    return apply_rotary_torch(positions, q, k, cos_sin)


def rotary_kernel_takes(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                        norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Whether the Triton rotary kernels (_rotary_kernel, store_kv's _rotary_store_kv_kernel) take
    these tensors: on CUDA with Triton, q and k of one dtype with contiguous last dims, a float32
    cos | sin table with a contiguous last dim; with Qwen3's q/k norm weights also contiguous
    weights of q's dtype and an even head dim the norm kernel holds."""
    tensors = (positions, q, k, cos_sin) + tuple(norm_weights or ())
    if not (_on_triton(*tensors) and q.stride(-1) == 1 and k.stride(-1) == 1 and q.dtype == k.dtype
            and cos_sin.stride(-1) == 1 and cos_sin.dtype == torch.float32):
        return False
    head_dim = q.shape[-1]
    return norm_weights is None or (head_dim % 2 == 0 and head_dim <= MAX_NORM_BLOCK
                                    and all(w.dtype == q.dtype and w.is_contiguous() for w in norm_weights))


def qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head q/k RMSNorm, then rotary: rms_norm(q), rms_norm(k), then apply_rotary,
    with their roundings (the normed values in q's dtype, as the norm stores them). On the GPU
    one launch that rotates q and k IN PLACE (issue 21: the two norm launches a layer were 96 of
    a batch-1 Qwen3-30B-A3B token's ~900 kernels); elsewhere the three ops. Use the return values."""
    if rotary_kernel_takes(positions, q, k, cos_sin, (q_weight, k_weight)):
        return apply_rotary_triton(positions, q, k, cos_sin, q_weight, k_weight, eps)
    return apply_rotary(positions, rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos_sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate first) -> silu(gate) * up: [T, I], a new tensor."""
    if _on_triton(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_torch(gate_up)


def _norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() in (2, 3) and x.stride(-1) == 1 and weight.dim() == 1 and weight.is_contiguous()
            and weight.shape[0] == x.shape[-1] and x.shape[-1] <= MAX_NORM_BLOCK)


# ------------------------------------------------------------------ kernels


@_jit
def _rms_norm_kernel(
    x_ptr,  # [T, heads, H] (heads = 1 for hidden states), last dim contiguous
    res_ptr,  # [T, H] residual (read only if HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [T, heads, H]; with QUANT_FP8: [T, H] e4m3
    res_out_ptr,  # [T, H] x + residual (written only if HAS_RESIDUAL)
    stride_xt, stride_xh, stride_rt, stride_ot, stride_oh, stride_st,
    num_heads, eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,  # next_pow2(H)
    ROWS: tl.constexpr,  # heads per program
    HAS_RESIDUAL: tl.constexpr,
    QUANT_FP8: tl.constexpr = False,  # (ROWS 1) the row quantized per token for an FP8 linear (kernels/fp8_act.py)
    scale_ptr=None,  # [T] float32 per-token scales (QUANT_FP8)
    FP8_MAX: tl.constexpr = 448.0, MIN_SCALE: tl.constexpr = 0.0,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    d = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = (h < num_heads) & (d < H)
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # s = x + residual rounded to the input dtype, as torch's add does
        r = tl.load(res_ptr + t * stride_rt + d, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + t * stride_st + d, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / H + eps)  # [ROWS]
    y = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty)  # HF: cast back before the weight
    w = tl.load(w_ptr + d, mask=d < H, other=0.0)
    out = y.to(tl.float32) * w.to(tl.float32)
    if QUANT_FP8:  # the unfused norm's stored row, quantized with fp8_gemm's quantizer arithmetic
        o = out.to(x_ptr.dtype.element_ty).to(tl.float32)  # the unfused norm's stored row (weight dtype = x's)
        s = tl.maximum(tl.div_rn(tl.max(tl.abs(o), axis=1), FP8_MAX), MIN_SCALE)  # [ROWS]
        tl.store(scale_ptr + t + tl.arange(0, ROWS), s)
        out = tl.clamp(tl.div_rn(o, s[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def rotate_heads(base_ptr, stride_h, num_heads, blk, w_ptr, eps, cos, sin, d, d_mask,
                 HALF: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr):
    """One token's heads [blk * ROWS, (blk + 1) * ROWS) of q or k, rotated in place; with NORM
    each head is RMSNorm-ed first (weight w_ptr), rounded as _rms_norm_kernel stores it."""
    h, mask, o1, o2 = rotated_heads(base_ptr, stride_h, num_heads, blk, w_ptr, eps, cos, sin, d, d_mask,
                                    HALF, ROWS, NORM)
    p1 = base_ptr + h * stride_h + d
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)


@_jit
def rotated_heads(base_ptr, stride_h, num_heads, blk, w_ptr, eps, cos, sin, d, d_mask,
                  HALF: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr):
    """One token's heads [blk * ROWS, (blk + 1) * ROWS) of q or k (at base_ptr, head stride
    stride_h), NORM-ed and rotated -> (heads [ROWS, 1], mask [ROWS, HALF_PAD], the two rotated
    halves [ROWS, HALF_PAD] in base_ptr's dtype, as the in-place rotation stores them)."""
    h = blk * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    mask = (h < num_heads) & d_mask
    p1 = base_ptr + h * stride_h + d  # first half; the second half is HALF further
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        dt = base_ptr.dtype.element_ty
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)  # [ROWS]
        # cast back before the weight, the product in the input dtype (HF's order, as the norm kernel)
        w1 = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd[:, None]).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * rstd[:, None]).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return h, mask, o1.to(base_ptr.dtype.element_ty), o2.to(base_ptr.dtype.element_ty)


@_jit
def _rotary_kernel(
    pos_ptr,  # [T] int32/int64
    q_ptr,  # [T, Hq, D], last dim contiguous
    k_ptr,  # [T, Hk, D]
    cs_ptr,  # [max_pos, D] fp32: cos | sin
    qw_ptr,  # [D] q norm weight (read only if NORM)
    kw_ptr,  # [D] k norm weight (read only if NORM)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_q_heads, num_k_heads, q_blocks, eps,  # programs 0..q_blocks-1 along axis 1 do q, the rest k
    HALF: tl.constexpr,  # D / 2
    HALF_PAD: tl.constexpr,  # next_pow2(HALF)
    ROWS: tl.constexpr,  # heads per program
    NORM: tl.constexpr,  # Qwen3: each head RMSNorm-ed (weights qw / kw) before the rotation
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
    t, blk, d, d_mask, cos, sin = token_cos_sin(pos_ptr, cs_ptr, stride_cs, HALF, HALF_PAD)
    if blk < q_blocks:
        rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, blk, qw_ptr, eps, cos, sin, d, d_mask,
                     HALF, ROWS, NORM)
    else:
        rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, blk - q_blocks, kw_ptr, eps, cos, sin, d,
                     d_mask, HALF, ROWS, NORM)


@_jit
def token_cos_sin(pos_ptr, cs_ptr, stride_cs, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """A rotary program's token t (axis 0) and head block (axis 1), the half-dim lanes d [1, HALF_PAD]
    with their mask, and the cos and sin rows of t's position [1, HALF_PAD] (float32)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    d_mask = d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d_mask, other=0.0)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d_mask, other=0.0)
    return t, tl.program_id(1), d, d_mask, cos, sin


@_jit
def _silu_and_mul_kernel(
    in_ptr,  # [T, 2I]: gate | up, last dim contiguous
    out_ptr,  # [T, I]
    stride_it, stride_ot,
    I: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < I
    g = tl.load(in_ptr + t * stride_it + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(in_ptr + t * stride_it + I + c, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(in_ptr.dtype.element_ty)  # torch's silu, rounded like torch
    out = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + c, out.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------ launchers (no fallback)


def norm_warps(elements: int) -> int:
    return max(1, min(16, elements // 256))  # ~8 elements (one 16-byte bf16 vector) per thread


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel path of `rms_norm`; `out` (x's shape, last dim contiguous) may be given."""
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # [T, heads, H]
    num_tokens, num_heads, hidden = x3.shape
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    o3 = out if out.dim() == 3 else out.unsqueeze(1)
    assert o3.shape == x3.shape and o3.stride(-1) == 1 and x3.stride(-1) == 1, (out.shape, x.shape)
    if num_tokens == 0 or num_heads == 0:
        return out
    block = triton.next_power_of_2(hidden)
    rows = min(triton.next_power_of_2(num_heads), max(1, 2048 // block))
    grid = (num_tokens, triton.cdiv(num_heads, rows))
    _rms_norm_kernel[grid](
        x3, x3, weight, o3, o3,
        x3.stride(0), x3.stride(1), 0, o3.stride(0), o3.stride(1), 0,
        num_heads, eps,
        H=hidden, BLOCK=block, ROWS=rows, HAS_RESIDUAL=False, num_warps=norm_warps(rows * block), **pdl_args(x),
    )
    return out


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              inplace: bool = False, out: torch.Tensor | None = None,
                              residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel path of `fused_add_rms_norm`: x, residual [T, H]; inplace writes into x, residual.

    Each program reads its whole row before writing it, so out/residual_out may alias x/residual
    row for row (that is what inplace does)."""
    num_tokens, hidden = x.shape
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype, x.dtype)
    if inplace:
        assert weight.dtype == x.dtype, "inplace needs the output dtype to equal the input dtype"
        out, residual_out = x, residual
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual_out is None:
        residual_out = torch.empty_like(x)
    for t in (x, residual, out, residual_out):
        assert t.shape == x.shape and t.stride(-1) == 1, (t.shape, t.stride())
    if num_tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens, 1)](
        x, residual, weight, out, residual_out,
        x.stride(0), 0, residual.stride(0), out.stride(0), 0, residual_out.stride(0),
        1, eps,
        H=hidden, BLOCK=block, ROWS=1, HAS_RESIDUAL=True, num_warps=norm_warps(block), **pdl_args(x),
    )
    return out, residual_out


def apply_rotary_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                        q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                        eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel path of `apply_rotary`: rotates q and k in place and returns them; with q_weight and
    k_weight (`qk_norm_rotary`'s path) each head is RMSNorm-ed first, in the same launch."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    norm = q_weight is not None
    assert k.shape == (num_tokens, num_k_heads, head_dim) and head_dim % 2 == 0, (q.shape, k.shape)
    assert cos_sin.shape[1] == head_dim and positions.shape[0] >= num_tokens, (cos_sin.shape, positions.shape)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1
    if norm:
        assert q_weight.shape == (head_dim,) and k_weight.shape == (head_dim,), (q_weight.shape, k_weight.shape)
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    half_pad = triton.next_power_of_2(half)
    rows = min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), max(1, 2048 // half_pad))
    q_blocks = triton.cdiv(num_q_heads, rows)
    grid = (num_tokens, q_blocks + triton.cdiv(num_k_heads, rows))
    _rotary_kernel[grid](
        positions, q, k, cos_sin, q_weight if norm else q, k_weight if norm else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        num_q_heads, num_k_heads, q_blocks, eps,
        HALF=half, HALF_PAD=half_pad, ROWS=rows, NORM=norm, num_warps=norm_warps(rows * half_pad), **pdl_args(q),
    )
    return q, k


def silu_and_mul_triton(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel path of `silu_and_mul`: gate_up [T, 2I] -> out [T, I]."""
    num_tokens, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(-1) == 1, (gate_up.shape, gate_up.stride())
    inter = two_i // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (num_tokens, inter) and out.stride(-1) == 1, (out.shape, out.stride())
    if num_tokens == 0:
        return out
    block = min(triton.next_power_of_2(inter), 2048)
    grid = (num_tokens, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        gate_up, out, gate_up.stride(0), out.stride(0),
        I=inter, BLOCK=block, num_warps=max(1, min(8, block // 512)), **pdl_args(gate_up),
    )
    return out

