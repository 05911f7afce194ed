"""PEFT adapter directories: read and check them against the model, load their weights.

A directory holds adapter_config.json (r, lora_alpha, target_modules, use_rslora, ...) and
adapter_model.safetensors with, per adapted linear, `...layers.N.<self_attn|mlp>.<name>.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]; the layer computes W x + scaling * B (A x), scaling =
lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Supported targets: q/k/v/o_proj and
gate/up/down_proj of the decoder layers. `read_adapter` checks everything from the config and
the safetensors header (no tensor is read), so a bad adapter is refused when it is registered or
requested (a clear ValueError), never in the middle of a step.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from minivllm.models.arch import ArchConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
WEIGHT_FILES = ("adapter_model.safetensors",)


@dataclass(frozen=True)
class AdapterSpec:
    """What read_adapter found: the weights file, rank, scaling and the (layer, module) pairs."""

    path: str
    weights_file: str
    rank: int
    scaling: float
    modules: tuple[tuple[int, str], ...]  # (layer index, module name), sorted
    keys: dict  # (layer, module, "A" | "B") -> tensor name in the file


def module_dims(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable linear of a decoder layer."""
    q, kv, h, i = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size, \
        arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_adapter(path: str, arch: ArchConfig, max_rank: int, name: str = "") -> AdapterSpec:
    """Check a PEFT adapter directory against the model and the rank limit; ValueError says why not."""
    label = f"LoRA adapter {name!r} ({path})" if name else f"LoRA adapter {path}"
    if not path or not os.path.isdir(path):
        raise ValueError(f"{label}: the path does not exist or is not a directory")
    cfg = _read_config(path, label)
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{label}: adapter_config.json has no valid rank r (got {rank!r})")
    if rank > max_rank:
        raise ValueError(f"{label}: rank {rank} exceeds max_lora_rank={max_rank} (start the engine with "
                         f"max_lora_rank >= {rank})")
    _refuse_unsupported(cfg, label)
    weights = next((os.path.join(path, f) for f in WEIGHT_FILES if os.path.isfile(os.path.join(path, f))), None)
    if weights is None:
        raise ValueError(f"{label}: no {' or '.join(WEIGHT_FILES)} in the directory")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    keys = _check_tensors(weights, arch, rank, label)
    modules = tuple(sorted({(layer, mod) for layer, mod, _ in keys}))
    return AdapterSpec(path, weights, rank, scaling, modules, keys)


def _read_config(path: str, label: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{label}: no adapter_config.json in the directory") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{label}: adapter_config.json could not be read: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{label}: adapter_config.json is not a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"{label}: peft_type {peft_type!r} is not supported (only LORA)")
    return cfg


def _refuse_unsupported(cfg: dict, label: str) -> None:
    if cfg.get("use_dora"):
        raise ValueError(f"{label}: DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise ValueError(f"{label}: bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{label}: modules_to_save {cfg['modules_to_save']} is not supported")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"{label}: fan_in_fan_out adapters are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"{label}: per-module ranks or alphas ({key}) are not supported")


def _check_tensors(weights: str, arch: ArchConfig, rank: int, label: str) -> dict:
    """Every tensor must be the A or B of a supported module of an existing layer, with this
    model's dimensions: an adapter of another base model fails here."""
    from safetensors import safe_open
    dims = module_dims(arch)
    keys: dict = {}
    with safe_open(weights, framework="pt") as f:
        for key in f.keys():
            m = _KEY.search(key)
            if m is None or m.group(2) not in MODULES:
                raise ValueError(f"{label}: tensor {key!r} is not a LoRA weight of {', '.join(MODULES)}")
            layer, mod, ab = int(m.group(1)), m.group(2), m.group(3)
            if layer >= arch.num_layers:
                raise ValueError(f"{label}: tensor {key!r} is for layer {layer}, but this model has "
                                 f"{arch.num_layers} layers: the adapter was made for a different base model")
            shape = tuple(f.get_slice(key).get_shape())
            d_in, d_out = dims[mod]
            want = (rank, d_in) if ab == "A" else (d_out, rank)
            if shape != want:
                raise ValueError(f"{label}: {key} has shape {list(shape)}, this model needs {list(want)} "
                                 f"(rank {rank}): the adapter was made for a different base model")
            keys[(layer, mod, ab)] = key
    for layer, mod, ab in list(keys):
        if (layer, mod, "B" if ab == "A" else "A") not in keys:
            raise ValueError(f"{label}: layer {layer} {mod} has lora_{ab} but not its pair")
    if not keys:
        raise ValueError(f"{label}: the weights file holds no LoRA weights")
    return keys


def load_adapter_weights(spec: AdapterSpec) -> dict[tuple[int, str], tuple]:
    """(layer, module) -> (A [r, in], B [out, r]) CPU tensors, as stored."""
    from safetensors.torch import load_file
    tensors = load_file(spec.weights_file)
    return {(layer, mod): (tensors[spec.keys[(layer, mod, "A")]], tensors[spec.keys[(layer, mod, "B")]])
            for layer, mod in spec.modules}
