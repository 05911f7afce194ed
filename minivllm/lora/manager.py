"""The runner's adapters: a host LRU of loaded adapters and an LRU of device slots.

    request's LoRARequest --(first use)--> read + load the PEFT files (host, max_cpu_loras kept)
                          --(step needs it)--> copy into a free or least recently used device
                                               slot (max_loras slots; never one this step uses)

The scheduler admits at most max_loras distinct adapters among running requests, so a step
never needs more slots than exist. `prepare_step` sets the model's LoRAStepState: the slot of
each token (-1: the base model), grouped by slot for the GPU kernel.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from minivllm.lora.adapter import load_adapter_weights, read_adapter
from minivllm.lora.config import LoRAConfig
from minivllm.lora.layers import LoRALinear, LoRAStepState, wrap_model
from minivllm.lora.ops import slot_segments
from minivllm.lora.request import LoRARequest

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B * scaling)


class LoRAManager:
    def __init__(self, config: LoRAConfig, model, arch, device: torch.device, dtype: torch.dtype,
                 max_tokens: int) -> None:
        self.config = config
        self.arch = arch
        self.device, self.dtype = device, dtype
        on_gpu = device.type == "cuda"
        zeros = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
        self.state = LoRAStepState(zeros(max_tokens), zeros(config.max_loras), zeros(config.max_loras),
                                   use_triton=on_gpu, active=on_gpu)
        self.layers = wrap_model(model, arch, self.state, config.max_loras, config.max_lora_rank, dtype, device)
        self.host: OrderedDict[int, Weights] = OrderedDict()  # lora_int_id -> weights, LRU order
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> device slot, LRU order

    # ---- adapters -------------------------------------------------------------------------
    def _host_weights(self, req: LoRARequest) -> Weights:
        w = self.host.get(req.lora_int_id)
        if w is not None:
            self.host.move_to_end(req.lora_int_id)
            return w
        spec = read_adapter(req.lora_path, self.arch, self.config.max_lora_rank, req.lora_name)
        w = {key: (a.to(self.dtype), (b.float() * spec.scaling).to(self.dtype))
             for key, (a, b) in load_adapter_weights(spec).items()}
        self.host[req.lora_int_id] = w
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        return w

    def _slot(self, req: LoRARequest, in_use: set[int]) -> int:
        slot = self.slot_of.get(req.lora_int_id)
        if slot is not None:
            self.slot_of.move_to_end(req.lora_int_id)
            return slot
        taken = set(self.slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:  # evict the least recently used adapter that this step does not use
            victim = next(i for i, s in self.slot_of.items() if s not in in_use)
            slot = self.slot_of.pop(victim)
        self._fill_slot(slot, self._host_weights(req))
        self.slot_of[req.lora_int_id] = slot
        return slot

    def _fill_slot(self, slot: int, weights: Weights) -> None:
        by_layer: dict[LoRALinear, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for layer in set(self.layers.values()):
            by_layer[layer] = {}
        for (idx, mod), ab in weights.items():
            by_layer[self.layers[(idx, mod)]][mod] = ab
        for layer, w in by_layer.items():
            layer.set_slot(slot, w)

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (unloaded by the server): its host copy and its slot."""
        self.host.pop(lora_int_id, None)
        self.slot_of.pop(lora_int_id, None)

    # ---- one step -------------------------------------------------------------------------
    def prepare_step(self, token_counts: list[int], loras: list[LoRARequest | None], num_tokens: int) -> None:
        """token_counts[i] tokens of the step's i-th request run with loras[i] (in the step's
        flattened order); num_tokens: the step's token count."""
        if len(set(r.lora_int_id for r in loras if r is not None)) > self.config.max_loras:
            raise RuntimeError("a step mixes more adapters than max_loras (the scheduler must prevent this)")
        in_use: set[int] = set()
        per_req: list[int] = []
        for r in loras:
            s = -1 if r is None else self._slot(r, in_use)
            if s >= 0:
                in_use.add(s)
            per_req.append(s)
        slots = torch.repeat_interleave(torch.tensor(per_req, dtype=torch.int32),
                                        torch.tensor(token_counts, dtype=torch.int64))
        if self.state.use_triton:
            # grouped on the host (a few hundred ints), one copy per buffer; graph padding rows
            # past num_tokens are in no segment
            order, start, count = slot_segments(slots, self.config.max_loras)
            self.state.order[:order.shape[0]].copy_(order, non_blocking=True)
            self.state.start.copy_(start, non_blocking=True)
            self.state.count.copy_(count, non_blocking=True)
            return
        self.state.active = bool(in_use)
        self.state.groups = [(s, (slots == s).nonzero().flatten()) for s in sorted(in_use)]
