"""The plain-PyTorch backend: the CPU path and the oracle for the fast kernels."""

from __future__ import annotations

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.reference import paged_attention_reference, store_kv_reference


class TorchAttentionBackend:
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, query: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.tolist()
        lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
        return paged_attention_reference(query, k_cache, v_cache, qsl, lens, meta.block_tables, scale)
