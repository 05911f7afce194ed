"""Builds the model on its device and fills its weights (GGUF, safetensors, or dummy)."""

from __future__ import annotations

import torch

from minivllm.attention.backend import AttentionBackend
from minivllm.config import ModelConfig
from minivllm.distributed.parallel_state import ParallelGroups
from minivllm.models.llama import CausalLM
from minivllm.models.weights import init_dummy_weights, iter_safetensors, load_weights
from minivllm.quant.layer import process_quantized_layers


def build_model(cfg: ModelConfig, backend: AttentionBackend, device: torch.device, dtype: torch.dtype,
                parallel: ParallelGroups | None = None) -> CausalLM:
    """parallel: this rank's groups (tensor/pipeline parallelism): the model holds, and loads,
    only this rank's shard of this stage's layers."""
    # created directly on the device in the target dtype (buffers that must stay fp32, such as
    # the rotary cos/sin table, are created with an explicit dtype)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg.arch, backend, cfg.max_model_len, cfg.quantization, parallel=parallel)
    except ValueError as e:  # a quantized layer's shape the format cannot take: say which model
        raise ValueError(f"model {cfg.served_name!r}: {e}") from e
    finally:
        torch.set_default_dtype(prev)
    if cfg.load_format == "dummy":
        init_dummy_weights(model, cfg.seed)
    elif cfg.source_kind == "gguf":
        from minivllm.models.gguf_loader import iter_gguf_weights, open_gguf
        load_weights(model, iter_gguf_weights(open_gguf(cfg.source_path), cfg.arch))
    else:
        load_weights(model, iter_safetensors(cfg.source_path))
    with torch.no_grad():
        process_quantized_layers(model)  # checkpoint layouts -> the kernels' (no-op unquantized)
    return model.eval()
