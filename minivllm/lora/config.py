"""LoRAConfig: the engine's multi-LoRA limits (vLLM's option names), validated at the edge."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LORA_RANK_LIMIT = 512


@dataclass(frozen=True)
class LoRAConfig:
    """max_loras: adapters one step may mix (device slots); max_lora_rank: the largest adapter rank
    (device slots are this wide); max_cpu_loras: adapters kept loaded on the host (LRU), at least
    max_loras."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.max_loras, int) and self.max_loras >= 1, "max_loras",
               f"must be an integer >= 1, got {self.max_loras!r}")
        _check(isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT,
               "max_lora_rank", f"must be an integer in [1, {MAX_LORA_RANK_LIMIT}], got {self.max_lora_rank!r}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        _check(isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
               f"must be an integer >= max_loras={self.max_loras}, got {self.max_cpu_loras!r}")


def _check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{name} {msg}")
