"""The reasoning parsers by model family (vLLM's names)."""

from __future__ import annotations

from minivllm.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the model writes `<think>` itself; output without it is all answer."""

    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the chat template opens `<think>`; output is reasoning until `</think>`."""

    name = "deepseek_r1"
    implicit_start = True
