"""Attention backend interface and registry (backends are imported lazily, by name)."""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from minivllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """What the model's attention layer calls. One instance serves every layer."""

    name: str

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
        k_scale: torch.Tensor | None = None,  # [1] float32: an FP8 cache stores K / k_scale
        v_scale: torch.Tensor | None = None,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # an FP8 cache's K is read back as K * k_scale
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


# name -> "module:class"; modules are imported only when the backend is chosen
_BACKENDS = {
    "torch": "minivllm.attention.torch_backend:TorchAttentionBackend",
    "triton": "minivllm.attention.triton_backend:TritonAttentionBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {available_backends()}, got {name!r}")
    module_name, cls_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)()
