"""Checkpoint tensors of the routed experts -> the stacked per-layer tensors of models/moe.py.

Names accepted under `layers.<i>.mlp.experts.` (Mixtral's `block_sparse_moe` is renamed `mlp`
before this):
    <e>.gate_proj.weight | <e>.w1.weight   [I, H]     -> w13[e, :I]
    <e>.up_proj.weight   | <e>.w3.weight   [I, H]     -> w13[e, I:]
    <e>.down_proj.weight | <e>.w2.weight   [H, I]     -> w2[e]
    gate_up_proj                           [E, 2I, H] -> w13 (transformers 5's in-memory layout)
    down_proj                              [E, H, I]  -> w2
Under expert parallelism a rank keeps only its experts (ExpertPlacement); under tensor
parallelism without it, every expert's slice of intermediate features [inter_start, + inter)
(gate/up rows, down columns). A tensor whose
expert id or shape disagrees with the config raises a ValueError naming the tensor.
"""

from __future__ import annotations

import torch

from minivllm.models.moe import FusedMoE

# checkpoint projection name -> (our parameter, shard: 0 gate rows, 1 up rows, None whole)
_PER_EXPERT = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
               "down_proj": ("w2", None), "w2": ("w2", None)}
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}


def is_expert_tensor(name: str) -> bool:
    return ".mlp.experts." in name


def load_expert_tensor(modules: dict, name: str, source, hf_name: str) -> list[str]:
    """Copy one checkpoint tensor (our naming: layers.<i>.mlp.experts.<rest>; a torch.Tensor or a
    weights.CheckpointTensor read here) into its layer's FusedMoE; returns the written keys (see
    expected_keys). Only this rank's part is read: its experts, and of each its slice of the
    intermediate features (tensor parallelism without expert parallelism)."""
    prefix, rest = name.split(".mlp.experts.", 1)
    experts = modules.get(prefix + ".mlp.experts")
    if not isinstance(experts, FusedMoE):
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model (layer {prefix!r} has no experts)")
    key = f"{prefix}.mlp.experts."
    parts = rest.split(".")
    if parts[0].isdigit() and len(parts) == 3 and parts[1] in _PER_EXPERT and parts[2] == "weight":
        param, shard = _PER_EXPERT[parts[1]]
        return _copy_one(experts, int(parts[0]), param, shard, source, hf_name, key + param)
    if rest in _STACKED:
        return _copy_stacked(experts, _STACKED[rest], source, hf_name, key + _STACKED[rest])
    raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")


def _read(source, cut: tuple[int, int, int] | None) -> torch.Tensor:
    """The tensor, or its [start, stop) along dim for cut = (dim, start, stop)."""
    if isinstance(source, torch.Tensor):
        return source if cut is None else source.narrow(cut[0], cut[1], cut[2] - cut[1])
    return source.read(cut)


def _copy_one(experts: FusedMoE, e: int, param: str, shard: int | None, source, hf_name: str,
              key: str) -> list[str]:
    place = experts.placement
    if e >= place.num_experts:
        raise ValueError(f"checkpoint tensor {hf_name!r} is for expert {e}, but the config has "
                         f"num_experts={place.num_experts}")
    if not place.owns(e):
        return []  # another expert-parallel rank holds it: never read
    local = e - place.first
    dst = getattr(experts, param).data[local]
    if shard is not None:
        dst = dst[shard * experts.inter:(shard + 1) * experts.inter]
    full, dim = ((experts.full_inter, experts.hidden), 0) if param == "w13" else ((experts.hidden, experts.full_inter), 1)
    _check_shape(source, full, hf_name)
    lo = experts.inter_start
    dst.copy_(_read(source, None if experts.inter == experts.full_inter else (dim, lo, lo + experts.inter)))
    return [f"{key}#{local}.{shard or 0}"]


def _copy_stacked(experts: FusedMoE, param: str, source, hf_name: str, key: str) -> list[str]:
    place, inter, full, lo = experts.placement, experts.inter, experts.full_inter, experts.inter_start
    dst = getattr(experts, param).data
    whole = (place.num_experts, 2 * full, experts.hidden) if param == "w13" else (place.num_experts, experts.hidden, full)
    _check_shape(source, whole, hf_name)
    mine = _read(source, None if place.size == 1 else (0, place.first, place.first + place.num_local))
    if param == "w13":  # this rank's gate rows, then its up rows
        dst.copy_(torch.cat([mine[:, lo:lo + inter], mine[:, full + lo:full + lo + inter]], dim=1))
    else:
        dst.copy_(mine[:, :, lo:lo + inter])
    shards = (0, 1) if param == "w13" else (0,)
    return [f"{key}#{e}.{s}" for e in range(place.num_local) for s in shards]


def _check_shape(tensor, expected, hf_name: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)} "
                         "(from the config's num_experts, moe_intermediate_size and hidden_size)")


def expected_keys(name: str, param: torch.Tensor) -> list[str] | None:
    """The keys load_expert_tensor writes for the parameter `name` (None: not an expert tensor):
    w13 one per local expert and half, w2 one per local expert."""
    if not is_expert_tensor(name):
        return None
    shards = (0, 1) if name.endswith(".w13") else (0,)
    return [f"{name}#{e}.{s}" for e in range(param.shape[0]) for s in shards]
