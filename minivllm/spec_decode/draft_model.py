"""A separate draft model: loaded like the target (same device, dtype and CPU setup), checked
against it (same vocabulary, long enough a context), with a KV cache of the target's block layout."""

from __future__ import annotations

import dataclasses
import logging

import torch

logger = logging.getLogger(__name__)


def load_draft_model(path: str, runner):
    """The draft CausalLM at `path` for the runner's target (raises ValueError naming the field)."""
    from minivllm.attention.backend import get_attention_backend
    from minivllm.models.source import load_arch
    from minivllm.models.loader import build_model
    from minivllm.models.source import resolve_model_source
    target = runner.config.model
    source = resolve_model_source(path)
    arch = load_arch(source)
    if arch.vocab_size != target.arch.vocab_size:
        raise ValueError(f"speculative_config.model: the draft {path!r} has a vocabulary of {arch.vocab_size} "
                         f"tokens, the target {target.served_name!r} {target.arch.vocab_size}: they must share a tokenizer")
    if arch.max_position_embeddings < target.max_model_len:
        raise ValueError(f"speculative_config.model: the draft {path!r} handles {arch.max_position_embeddings} "
                         f"positions, fewer than max_model_len={target.max_model_len}")
    # the draft's own quantization (its checkpoint's quantization_config), not the target's
    from minivllm.models.source import resolve_quantization
    quant = resolve_quantization(source, None, runner.config.device)
    cfg = dataclasses.replace(target, model=path, source_kind=source.kind, source_path=source.path,
                              served_name=source.name, arch=arch, load_format="auto", quantization=quant)
    model = build_model(cfg, get_attention_backend(runner.config.attention_backend), runner.device, runner.dtype)
    runner.setup_cpu_model(model)
    logger.info("speculative decoding: draft model %s (%d layers)", source.name, arch.num_layers)
    return model


def draft_kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    from minivllm.runner.kv_cache import bytes_per_block
    return bytes_per_block(model.cfg, block_size, dtype)
