"""Triton kernel: write the new tokens' K/V into the paged cache.

One program per token copies that token's [num_kv_heads, head_dim] key and value rows into
slot `slot_mapping[t]` (= block_id * block_size + offset) of k_cache / v_cache. A slot of -1
(CUDA-graph padding) is skipped. An FP8 (e4m3) cache stores K / k_scale and V / v_scale,
saturated at +-448. The reference is `store_kv_reference` in minivllm/attention/reference.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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
    if KV_FP8:
        k = tl.clamp(k.to(tl.float32) / tl.load(k_scale_ptr), -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / tl.load(v_scale_ptr), -448.0, 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


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
