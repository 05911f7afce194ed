"""The engine's check of a request's LoRARequest: enabled, not reused for other weights, a valid
adapter for this model (lora/adapter.py); results are cached per adapter id."""

from __future__ import annotations

from minivllm.lora.adapter import AdapterSpec, read_adapter
from minivllm.lora.config import LoRAConfig
from minivllm.lora.request import LoRARequest
from minivllm.models.arch import ArchConfig


def cache_salt(lora: LoRARequest | None) -> int | None:
    """The first parent hash of a request's block-hash chain: its adapter's (None: the base model)."""
    return None if lora is None else hash(("lora", lora.lora_int_id))


class AdapterChecker:
    def __init__(self, lora: LoRAConfig | None, arch: ArchConfig, served_name: str) -> None:
        self.lora = lora
        self.arch = arch
        self.served_name = served_name
        self._specs: dict[int, tuple[str, AdapterSpec]] = {}  # lora_int_id -> (path, spec)

    def check(self, req: LoRARequest | None) -> AdapterSpec | None:
        if req is None:
            return None
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        if self.lora is None:
            raise ValueError(f"lora_request {req.lora_name!r} needs an engine started with enable_lora=True")
        if req.base_model_name is not None and req.base_model_name != self.served_name:
            raise ValueError(f"LoRA adapter {req.lora_name!r} is for base model {req.base_model_name!r}, "
                             f"this engine serves {self.served_name!r}")
        known = self._specs.get(req.lora_int_id)
        if known is not None:
            if known[0] != req.lora_path:
                raise ValueError(f"lora_int_id {req.lora_int_id} is already used by the adapter at {known[0]!r}; "
                                 f"give {req.lora_path!r} another id")
            return known[1]
        spec = read_adapter(req.lora_path, self.arch, self.lora.max_lora_rank, req.lora_name)
        self._specs[req.lora_int_id] = (req.lora_path, spec)
        return spec
