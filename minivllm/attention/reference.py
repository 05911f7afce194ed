"""Plain-PyTorch paged attention: the reference every fast kernel is tested against.

Works on any device; slow (a Python loop over sequences) but obviously correct.
"""

from __future__ import annotations

import torch


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = do not store
) -> None:
    """Write each token's K/V into its slot (slot = block_id * block_size + offset)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat[slots] = key[valid].to(k_cache.dtype)
    v_flat[slots] = value[valid].to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, H, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: list[int],  # [num_seqs + 1]
    seq_lens: list[int],  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
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
        k = gather_kv(k_cache, block_tables[i], seq_len).float()
        v = gather_kv(v_cache, block_tables[i], seq_len).float()
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
