"""Triton kernels: write the new tokens' K/V into the paged cache.

`store_kv`: one program per token copies that token's [num_kv_heads, head_dim] key and value rows
into slot `slot_mapping[t]` (= block_id * block_size + offset) of k_cache / v_cache. A slot of -1
(CUDA-graph padding) is skipped. An FP8 (e4m3) cache stores K / k_scale and V / v_scale,
saturated at +-448. The reference is `store_kv_reference` in minivllm/attention/reference.py.

`rotary_store_kv`: the rotary embedding (with Qwen3's q/k RMSNorm when given) and the store in
one launch: q is rotated in place, and the rotated keys go straight to the cache with the values
(fused_ops' apply_rotary / qk_norm_rotary then store_kv, with their roundings: the same bits,
one launch a layer fewer in decode).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from minivllm.kernels.fused_ops import norm_warps, rotary_kernel_takes, rotate_heads, rotated_heads, token_cos_sin
from minivllm.kernels.pdl import enter_after_previous, pdl_args

# How the attention kernels widen FP8 (e4m3) K/V tiles in registers: to float16 (default: one
# cvt.rn.f16x2.e4m3x2 per two values on sm89+, widening to bfloat16 takes that and two more
# conversions) or to the query's dtype (MINIVLLM_FP8_KV_WIDEN=query, the layout before lease 17).
# The environment is read once, at import; the module attribute at each launch, so a benchmark or
# test may set it.
FP8_WIDEN_F16 = os.environ.get("MINIVLLM_FP8_KV_WIDEN", "fp16") != "query"


def fp8_widen_f16(query: torch.Tensor) -> bool:
    """The attention kernels' WIDEN_F16 flag for this query: FP8_WIDEN_F16, for 16-bit queries
    (a float32 query keeps float32 products)."""
    return FP8_WIDEN_F16 and query.dtype != torch.float32


@triton.jit
def _cache_value(x, scale_ptr, KV_FP8: tl.constexpr):
    """x in the model's dtype -> what the cache holds: x itself, or for an FP8 cache x / scale
    saturated at +-448 (in float32; the store converts). Both store kernels write through it."""
    if KV_FP8:
        y = tl.clamp(x.to(tl.float32) / tl.load(scale_ptr), -448.0, 448.0)
    else:
        y = x
    return y


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_ptr,  # [num_tokens] int64
    k_scale_ptr, v_scale_ptr,  # [1] float32 (read only when KV_FP8)
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,  # shared by k_cache and v_cache
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    H_PAD: tl.constexpr,  # next_pow2(NUM_KV_HEADS)
    D_PAD: tl.constexpr,  # next_pow2(HEAD_DIM)
    KV_FP8: tl.constexpr,  # the cache is float8 e4m3: store x / scale
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    # slot < 0 masks the whole row out: nothing is read or written for padding tokens
    # (slot is broadcast to a tensor first: the interpreter mishandles tensor & scalar-bool)
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & ((h * 0 + slot) >= 0)
    block = slot // BLOCK_SIZE  # int64: block * stride never overflows on large caches
    offset = slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d * stride_cd
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + dst, _cache_value(k, k_scale_ptr, KV_FP8).to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, _cache_value(v, v_scale_ptr, KV_FP8).to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_store_kv_kernel(
    pos_ptr,  # [T] int32/int64
    q_ptr,  # [T, Hq, D], rotated in place
    k_ptr, v_ptr,  # [T, Hk, D] each (read only)
    cs_ptr,  # [max_pos, D] fp32: cos | sin
    qw_ptr, kw_ptr,  # [D] q / k norm weights (read only if NORM)
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hk, D], last dim contiguous, the same strides
    slot_ptr,  # [T] int64, -1 = skip
    k_scale_ptr, v_scale_ptr,  # [1] float32 (read only when KV_FP8)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_cb, stride_cbs, stride_ch,  # the caches' block, slot and head strides
    num_q_heads, num_k_heads, q_blocks, eps,  # programs 0..q_blocks-1 along axis 1 do q, the rest k and v
    HALF: tl.constexpr,  # D / 2
    HALF_PAD: tl.constexpr,  # next_pow2(HALF)
    ROWS: tl.constexpr,  # heads per program
    NORM: tl.constexpr,  # Qwen3: each q / k head RMSNorm-ed (weights qw / kw) before the rotation
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    KV_FP8: tl.constexpr,  # the cache is float8 e4m3: store x / scale
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
    t, blk, d, d_mask, cos, sin = token_cos_sin(pos_ptr, cs_ptr, stride_cs, HALF, HALF_PAD)
    if blk < q_blocks:
        rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, blk, qw_ptr, eps, cos, sin, d, d_mask,
                     HALF, ROWS, NORM)
    else:
        h, mask, k1, k2 = rotated_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, blk - q_blocks, kw_ptr, eps,
                                        cos, sin, d, d_mask, HALF, ROWS, NORM)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        mask = mask & ((h * 0 + slot) >= 0)  # padding tokens (slot -1) store nothing
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cbs + h * stride_ch + d
        v_src = v_ptr + t * stride_vt + h * stride_vh + d
        v1 = tl.load(v_src, mask=mask, other=0.0)
        v2 = tl.load(v_src + HALF, mask=mask, other=0.0)
        dt = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, _cache_value(k1, k_scale_ptr, KV_FP8).to(dt), mask=mask)
        tl.store(k_cache_ptr + dst + HALF, _cache_value(k2, k_scale_ptr, KV_FP8).to(dt), mask=mask)
        tl.store(v_cache_ptr + dst, _cache_value(v1, v_scale_ptr, KV_FP8).to(dt), mask=mask)
        tl.store(v_cache_ptr + dst + HALF, _cache_value(v2, v_scale_ptr, KV_FP8).to(dt), mask=mask)


def rotary_store_enabled() -> bool:
    """rotary_store_kv's single launch, unless MINIVLLM_ROTARY_STORE_KV=0 (A/B runs: the two
    launches). Read at each call."""
    return os.environ.get("MINIVLLM_ROTARY_STORE_KV", "1") != "0"


def can_rotary_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     norm_weights: tuple | None) -> bool:
    """Whether rotary_store_kv's kernel takes these tensors: what the rotary kernels take
    (fused_ops.rotary_kernel_takes), and a v like k, an even head dim, caches on CUDA of one shape
    and strides with a contiguous last dim, in q's dtype or FP8."""
    return (rotary_store_enabled() and rotary_kernel_takes(positions, q, k, cos_sin, norm_weights)
            and v.is_cuda and v.stride(-1) == 1 and v.dtype == q.dtype and k.shape == v.shape
            and q.shape[-1] % 2 == 0 and k_cache.is_cuda and v_cache.is_cuda and k_cache.dim() == 4
            and k_cache.stride(-1) == 1 and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
            and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride())


def rotary_store_kv(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq, D]: rotated IN PLACE
    k: torch.Tensor,  # [T, Hk, D]: read only (the rotated keys go to the cache)
    v: torch.Tensor,  # [T, Hk, D]
    cos_sin: torch.Tensor,  # [max_pos, D] float32: cos | sin
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [1] float32, FP8 caches only (None: 1.0)
    v_scale: torch.Tensor | None = None,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,  # Qwen3's (q_norm, k_norm) weights [D]
    eps: float = 0.0,
) -> torch.Tensor:
    """apply_rotary (qk_norm_rotary with norm_weights) then store_kv in one launch: returns q,
    rotated in place; the rotated k and v are in their cache slots (callers check
    can_rotary_store first)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_k_heads, head_dim), (q.shape, k.shape, v.shape)
    assert k_cache.shape[2:] == (num_k_heads, head_dim) and positions.shape[0] >= num_tokens
    assert slot_mapping.shape[0] >= num_tokens and cos_sin.shape[1] == head_dim
    if num_tokens == 0:
        return q
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_scale, v_scale = kv_scale_args(fp8, k_scale, v_scale, k_cache)
    half = head_dim // 2
    half_pad = triton.next_power_of_2(half)
    rows = min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), max(1, 2048 // half_pad))
    q_blocks = triton.cdiv(num_q_heads, rows)
    grid = (num_tokens, q_blocks + triton.cdiv(num_k_heads, rows))
    q_weight, k_weight = norm_weights if norm_weights is not None else (q, k)
    _rotary_store_kv_kernel[grid](
        positions, q, k, v, cos_sin, q_weight, k_weight, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
        *k_cache.stride()[:3], num_q_heads, num_k_heads, q_blocks, eps,
        HALF=half, HALF_PAD=half_pad, ROWS=rows, NORM=norm_weights is not None, BLOCK_SIZE=k_cache.shape[1],
        KV_FP8=fp8, num_warps=norm_warps(rows * half_pad), **pdl_args(q),
    )
    return q


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (any strides)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (or int32), -1 = skip
    k_scale: torch.Tensor | None = None,  # [1] float32, FP8 caches only (None: 1.0)
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store each token's K/V in its cache slot; slots of -1 are left untouched."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), (k_cache.shape, key.shape)
    assert slot_mapping.shape[0] >= num_tokens
    if num_tokens == 0:
        return
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_scale, v_scale = kv_scale_args(fp8, k_scale, v_scale, k_cache)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        *key.stride(), *value.stride(), *k_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        KV_FP8=fp8,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1, **pdl_args(key),
    )


def kv_scale_args(fp8: bool, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                  cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale pointers a kernel gets: the [1] float32 scales for an FP8 cache (1.0 where
    none is given), else any tensor (never read)."""
    if not fp8:
        return cache, cache
    one = None
    if k_scale is None or v_scale is None:
        one = torch.ones(1, dtype=torch.float32, device=cache.device)
    return (one if k_scale is None else k_scale), (one if v_scale is None else v_scale)
