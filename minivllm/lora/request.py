"""LoRARequest: which adapter a request runs with (mirrors vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's name (the server's `model` field); lora_int_id: a unique id >= 1 (it
    keys the engine's adapter caches and salts the prefix cache: never reuse one for other weights);
    lora_path: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors);
    base_model_name: if given, must be the served model's name."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must name the adapter's directory (adapter {self.lora_name!r})")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
