"""Plain-PyTorch paged attention: the reference every fast kernel is tested against.

Works on any device; slow (a Python loop over sequences) but obviously correct.
"""

from __future__ import annotations

import torch


FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """K or V rows as the cache stores them: an FP8 (e4m3) cache holds x / scale, saturated at
    +-448 (a plain cast would turn larger values into NaN); other caches x in their dtype."""
    if cache_dtype != FP8_KV:
        return x.to(cache_dtype)
    s = scale.float() if scale is not None else 1.0
    return (x.float() / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV)


def from_cache(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows back in `dtype`: an FP8 cache's values times their scale."""
    if x.dtype != FP8_KV:
        return x.to(dtype)
    y = x.to(torch.float32)
    return (y * scale.float() if scale is not None else y).to(dtype)


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = do not store
    k_scale: torch.Tensor | None = None,  # [1] float32, FP8 caches only
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's K/V into its slot (slot = block_id * block_size + offset)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_flat = as_indexable(k_cache).view(-1, *k_cache.shape[2:])
    v_flat = as_indexable(v_cache).view(-1, *v_cache.shape[2:])
    k_flat[slots] = as_indexable(to_cache(key[valid], k_cache.dtype, k_scale))
    v_flat[slots] = as_indexable(to_cache(value[valid], v_cache.dtype, v_scale))


def as_indexable(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes (uint8): the CPU lacks index_copy / index_put / index_select
    for float8 dtypes; view the result back with .view(FP8_KV)."""
    return t.view(torch.uint8) if t.dtype == FP8_KV else t


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = as_indexable(cache)[block_table[:num_blocks].long()].view(cache.dtype)  # [num_blocks, block_size, H, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: list[int],  # [num_seqs + 1]
    seq_lens: list[int],  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    k_scale: torch.Tensor | None = None,  # [1] float32, FP8 caches only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole paged context.

    The K/V of the new tokens must already be stored in the cache. Computed in fp32.
    """
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = from_cache(gather_kv(k_cache, block_tables[i], seq_len), k_scale, torch.float32)
        v = from_cache(gather_kv(v_cache, block_tables[i], seq_len), v_scale, torch.float32)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, seq_len, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[start:end].float().transpose(0, 1)  # [H, q_len, D]
        # query j sits at position seq_len - q_len + j and sees keys 0..that position
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1).to(query.dtype)
    return out
