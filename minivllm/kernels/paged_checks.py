"""Input checks shared by the paged-attention kernels (internal invariants of the runner)."""

from __future__ import annotations

import torch


def check_paged_shapes(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables) -> None:
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[3] == head_dim, (k_cache.shape, query.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert query_start_loc.shape[0] == seq_lens.shape[0] + 1
    assert block_tables.shape[0] >= seq_lens.shape[0] and block_tables.stride(1) == 1
    assert query_start_loc.dtype == seq_lens.dtype == block_tables.dtype == torch.int32
