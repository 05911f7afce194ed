"""Put HF-named weights into our modules (q/k/v and gate/up go into fused matrices).

Under tensor parallelism each rank reads only its slice of every sharded tensor straight from the
file (safetensors slices; GGUF rows dequantized on their own), so no rank ever holds the whole
model; under pipeline parallelism a stage skips the layers it does not run."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from minivllm.models.llama import CausalLM
from minivllm.models.moe_weights import expected_keys, is_expert_tensor, load_expert_tensor

# HF sub-module name -> (our fused parameter, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class CheckpointTensor(Protocol):
    """A tensor of a checkpoint file, read on demand: whole, or a slice along one dimension."""

    shape: tuple[int, ...]

    def read(self, cut: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The whole tensor, or its [start, stop) along dim for cut = (dim, start, stop)."""
        ...


class _SafetensorsTensor:
    def __init__(self, handle, name: str) -> None:
        self.handle, self.name = handle, name
        self.shape = tuple(handle.get_slice(name).get_shape())

    def read(self, cut: tuple[int, int, int] | None = None) -> torch.Tensor:
        if cut is None:
            return self.handle.get_tensor(self.name)
        dim, start, stop = cut  # only these bytes are read
        index = (slice(None),) * dim + (slice(start, stop),)
        return self.handle.get_slice(self.name)[index]


def iter_safetensors(path: str) -> Iterator[tuple[str, CheckpointTensor]]:
    """(HF name, tensor read on demand) for every tensor of the directory's files; each must be
    read before the iteration moves on (its file is closed after its last tensor)."""
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, f) for f in files]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, _SafetensorsTensor(f, name)


def _shard_bounds(model: CausalLM, fused: str, shard: int, target: str) -> tuple[int, int]:
    """Output features of shard `shard` (q, k, v / gate, up) of the fused parameter `target` on
    this rank (gate_up: two halves as wide as that MLP: a dense layer's share of intermediate_size,
    or a MoE shared expert's)."""
    cfg, plan = model.cfg, model.plan
    if fused == "qkv_proj":
        q, kv = plan.num_heads * cfg.head_dim, plan.num_kv_heads * cfg.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
    shared = ".shared_expert." in target and cfg.moe is not None
    inter = plan.shared_expert_intermediate_size if shared else plan.intermediate_size
    return [(0, inter), (inter, 2 * inter)][shard]


# checkpoint tensors the engine does not use: static FP8 activation scales (activations are
# quantized per token at run time instead), compressed-tensors' record of the unpacked shape
_SKIP_SUFFIXES = (".input_scale", ".weight_shape")
# per-tensor FP8 KV-cache scales -> (the attention module's buffer(s)); vLLM's names for them
_KV_SCALES = {"self_attn.k_scale": ("k_scale",), "self_attn.v_scale": ("v_scale",),
              "self_attn.kv_scale": ("k_scale", "v_scale"), "self_attn.k_proj.output_scale": ("k_scale",),
              "self_attn.v_proj.output_scale": ("v_scale",)}


def load_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
    """Copy every weight (or this rank's slice of it) into place; raise if a parameter of the
    model was never written."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    written: set[str] = set()
    for hf_name, source in weights:
        name = _local_name(model, params, hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp."))
        if name is None:  # (Mixtral's MoE block is named block_sparse_moe)
            continue
        if is_expert_tensor(name):  # read there: only this rank's experts, only its slice of each
            written.update(load_expert_tensor(modules, name, source, hf_name))
            continue
        tensor = _read_shard(model, name, source)
        if _load_kv_scale(model, name, tensor):
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
            _copy(params, target, tensor, hf_name, rows=_shard_bounds(model, fused, shard, target))
            shared = target in params and getattr(params[target], "shared", False)
            written.add(target if shared else f"{target}#{shard}")
        else:
            _copy(params, name, tensor, hf_name)
            written.add(name)
    _check_all_written(model, params, written)


def _local_name(model: CausalLM, params: dict, name: str) -> str | None:
    """The model's parameter name for a checkpoint name (HF's, "model." removed), None for a
    tensor this rank does not load: unused ones, a tied LM head, another pipeline stage's."""
    if "rotary_emb" in name or name.endswith(_SKIP_SUFFIXES):
        return None
    tied = model.cfg.tie_word_embeddings
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        local = int(index) - model.layer_start
        return f"layers.{local}.{rest}" if 0 <= local < len(model.layers) else None
    if name == "lm_head.weight":
        return None if tied or model.lm_head is None else _lm_head_param(params)
    if name == "embed_tokens.weight" and model.embed_tokens is None:
        # a later pipeline stage of a tied model: its LM head is the embedding
        return _lm_head_param(params) if tied and model.lm_head is not None else None
    if name == "norm.weight" and model.norm is None:
        return None
    return name


def _lm_head_param(params: dict) -> str:
    return "lm_head.weight" if "lm_head.weight" in params else "lm_head.linear.weight"


def _read_shard(model: CausalLM, name: str, source) -> torch.Tensor:
    """This rank's part of a checkpoint tensor (distributed/sharding.py); rows past the real
    vocabulary (the padding of a vocabulary-parallel layer) are zeros."""
    parts = name.split(".")
    kind = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) >= 2 else parts[0]
    if kind == "linear":  # lm_head.linear.weight
        kind = "lm_head"
    if ".shared_expert." in name and kind in ("gate_proj", "up_proj", "down_proj"):
        kind = "shared_" + kind  # a MoE layer's shared expert: its own width
    cut = model.plan.checkpoint_slice(kind, model.rank, model.cfg.head_dim)
    if cut is None or (parts[-1] == "bias" and cut[0] != 0):
        return source if isinstance(source, torch.Tensor) else source.read()
    dim, start, length = cut
    stop = min(start + length, source.shape[dim])
    if isinstance(source, torch.Tensor):
        part = source.narrow(dim, start, max(stop - start, 0))
    else:
        part = source.read((dim, start, max(stop, start)))
    if part.shape[dim] < length:
        pad = list(part.shape)
        pad[dim] = length - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad)], dim)
    return part


def _load_kv_scale(model: CausalLM, name: str, tensor: torch.Tensor) -> bool:
    """layers.N.self_attn.k_scale (and vLLM's other names) -> that layer's FP8 KV scale buffers."""
    for suffix, buffers in _KV_SCALES.items():
        if name.endswith("." + suffix) and name.startswith("layers."):
            attn = model.layers[int(name.split(".")[1])].self_attn
            for b in buffers:
                getattr(attn, b).fill_(float(tensor.float().max()))
            return True
    return False


def _copy(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, hf_name: str,
          rows: tuple[int, int] | None = None) -> None:
    """Copy a checkpoint tensor into the parameter, or into the slice of its output features
    `rows` (a fused layer's shard). Quantized parameters say where that slice lies
    (quant/layer.py: output_dim, pack_factor, shared, fill_scalar)."""
    if name not in params:
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
    p = params[name]
    dst = p.data
    if rows is not None and not getattr(p, "shared", False):
        dim, factor = getattr(p, "output_dim", 0), getattr(p, "pack_factor", 1)
        dst = dst.narrow(dim, rows[0] // factor, (rows[1] - rows[0]) // factor)
    if getattr(p, "fill_scalar", False) and tensor.numel() == 1:
        dst.fill_(tensor.float().item())  # a per-tensor scale over this slice's channels
    elif dst.shape != tensor.shape and not (getattr(p, "fill_scalar", False) and dst.numel() == tensor.numel()):
        raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    elif getattr(p, "shared", False) and getattr(p, "loaded", False) and not torch.equal(dst, tensor.to(dst)):
        raise ValueError(f"checkpoint tensor {hf_name!r} differs from the one of another shard of the same layer")
    else:
        dst.copy_(tensor.reshape(dst.shape))
    p.loaded = True


def _check_all_written(model: CausalLM, params: dict, written: set[str]) -> None:
    missing = []
    for name, p in params.items():
        experts = expected_keys(name, p)
        if experts is not None:
            missing += [k for k in experts if k not in written]
            continue
        if getattr(p, "optional", False):
            continue
        if getattr(p, "shared", False):
            shards = 0
        elif ".qkv_proj." in name:
            shards = 3
        elif ".gate_up_proj." in name:
            shards = 2
        else:
            shards = 0
        if shards:
            missing += [f"{name}#{i}" for i in range(shards) if f"{name}#{i}" not in written]
        elif name not in written:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint lacks weights for {missing[:5]}{'...' if len(missing) > 5 else ''}")


def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights with the real shapes (for speed benchmarks): small uniform values so
    activations stay finite in bf16; norms stay 1. Quantized layers fill their checkpoint
    tensors themselves (packed integers, scales: quant/layer.py)."""
    from minivllm.quant.layer import init_dummy_quantized
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        done = init_dummy_quantized(model, gen)
        for name, p in model.named_parameters():
            if name in done:
                continue
            if "norm" in name:
                p.fill_(1.0)
            else:  # generated where the weight lives: fast even for 8B parameters
                p.uniform_(-0.02, 0.02, generator=gen)
