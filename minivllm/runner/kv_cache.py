"""KV cache sizing and allocation: per layer, K and V are [num_blocks, block_size, Hkv, D]."""

from __future__ import annotations

import logging

import torch

from minivllm.models.arch import ArchConfig

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def allocate_kv_cache(arch: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(arch.num_layers)]


def format_bytes(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"
