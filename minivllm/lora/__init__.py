"""Multi-LoRA serving: adapter requests, PEFT adapter files, LoRA layers and batched LoRA ops.

`request.py` (pure Python) is what crosses process boundaries; the rest imports torch."""

from minivllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
