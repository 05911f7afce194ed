"""Put HF-named weights into our modules (q/k/v and gate/up go into fused matrices)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minivllm.models.llama import CausalLM
from minivllm.models.moe_weights import expected_keys, is_expert_tensor, load_expert_tensor

# HF sub-module name -> (our fused parameter, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
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
                yield name, f.get_tensor(name)


def _shard_bounds(model: CausalLM, fused: str, shard: int, rows: int) -> tuple[int, int]:
    """Rows of shard `shard` in a fused matrix of `rows` rows (gate_up: two halves, as wide as
    that MLP: a dense layer's, a shared expert's)."""
    cfg = model.cfg
    if fused == "qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
    inter = rows // 2
    return [(0, inter), (inter, 2 * inter)][shard]


def load_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every weight into place; raise if a parameter of the model was never written."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    written: set[str] = set()
    for hf_name, tensor in weights:
        name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")  # Mixtral's MoE block
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        if is_expert_tensor(name):
            written.update(load_expert_tensor(modules, name, tensor, hf_name))
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
            if target not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            lo, hi = _shard_bounds(model, fused, shard, params[target].shape[0])
            _copy(params, target, tensor, hf_name, rows=(lo, hi))
            written.add(f"{target}#{shard}")
        else:
            _copy(params, name, tensor, hf_name)
            written.add(name)
    _check_all_written(model, params, written)


def _copy(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, hf_name: str,
          rows: tuple[int, int] | None = None) -> None:
    if name not in params:
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
    dst = params[name].data if rows is None else params[name].data[rows[0]:rows[1]]
    if dst.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(tensor)


def _check_all_written(model: CausalLM, params: dict, written: set[str]) -> None:
    missing = []
    for name, p in params.items():
        experts = expected_keys(name, p)
        if experts is not None:
            missing += [k for k in experts if k not in written]
            continue
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            shards = 3
        elif name.endswith("gate_up_proj.weight"):
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
    activations stay finite in bf16; norms stay 1."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:  # generated where the weight lives: fast even for 8B parameters
                p.uniform_(-0.02, 0.02, generator=gen)
