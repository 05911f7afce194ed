"""KV cache sizing and allocation: per layer, K and V are [num_blocks, block_size, Hkv, D]."""

from __future__ import annotations

import logging

import torch

from minivllm.models.arch import ArchConfig

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


def kv_shape(of: ArchConfig | torch.nn.Module) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) whose K/V a cache holds: a whole architecture's, or a loaded
    model's (a rank's: its pipeline stage's layers, its share of the KV heads)."""
    if isinstance(of, ArchConfig):
        return of.num_layers, of.num_kv_heads, of.head_dim
    return len(of.layers), of.layers[0].self_attn.num_kv_heads, of.cfg.head_dim


def bytes_per_block(of: ArchConfig | torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    layers, kv_heads, head_dim = kv_shape(of)
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * layers * block_size * kv_heads * head_dim * elem


def allocate_kv_cache(of: ArchConfig | torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers, kv_heads, head_dim = kv_shape(of)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(layers)]


def format_bytes(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"
