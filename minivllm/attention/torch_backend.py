"""The plain-PyTorch backend: the CPU path. Decode rows are batched into one SDPA call over
the gathered blocks; prefill rows run one SDPA call each. Tested against reference.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.reference import gather_kv, store_kv_reference


class TorchAttentionBackend:
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if slot_mapping.device.type == "cpu" and bool((slot_mapping >= 0).all()):
            # no padding slots (the CPU runs no CUDA graphs): one index_copy_ per cache instead
            # of the reference's boolean-mask gathers
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))
            return
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, query: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.tolist()
        lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
        out = torch.empty_like(query)
        decode_rows = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
        if decode_rows:
            _decode(query, k_cache, v_cache, meta, decode_rows, qsl, scale, out)
        for i, seq_len in enumerate(lens):
            start, end = qsl[i], qsl[i + 1]
            if end - start > 1:
                out[start:end] = _prefill_one(query[start:end], k_cache, v_cache, meta.block_tables[i], seq_len, scale)
        return out


def _decode(query, k_cache, v_cache, meta, rows: list[int], qsl: list[int], scale: float, out) -> None:
    """One query token per row: gather each row's blocks, mask past its length, one SDPA call."""
    all_rows = len(rows) == meta.num_seqs
    idx = None if all_rows else torch.tensor(rows, device=query.device)
    tables = meta.block_tables if all_rows else meta.block_tables[idx]
    seq_lens = meta.seq_lens if all_rows else meta.seq_lens[idx]
    token_rows = [qsl[i] for i in rows]
    q = query if all_rows and len(token_rows) == query.shape[0] else query[token_rows]
    b, num_kv, d = q.shape[0], k_cache.shape[2], k_cache.shape[3]
    num_blocks = -(-int(max(meta.seq_lens_cpu[i] for i in rows) if meta.seq_lens_cpu else seq_lens.max()) // k_cache.shape[1])
    tables = tables[:, :num_blocks].reshape(-1)
    k = k_cache.index_select(0, tables).view(b, -1, num_kv, d).transpose(1, 2)  # [B, Hk, L, D]
    v = v_cache.index_select(0, tables).view(b, -1, num_kv, d).transpose(1, 2)
    valid = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=scale,
                                       enable_gqa=True)  # [B, Hq, 1, D]
    if all_rows and len(token_rows) == query.shape[0]:
        out.copy_(o.squeeze(2))
    else:
        out[token_rows] = o.squeeze(2)


def _prefill_one(q, k_cache, v_cache, block_table, seq_len: int, scale: float) -> torch.Tensor:
    q_len = q.shape[0]
    k = gather_kv(k_cache, block_table, seq_len).transpose(0, 1)  # [Hk, L, D]
    v = gather_kv(v_cache, block_table, seq_len).transpose(0, 1)
    qt = q.transpose(0, 1)  # [Hq, q_len, D]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # a chunk after a cached prefix: query j sits at position seq_len - q_len + j
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)
