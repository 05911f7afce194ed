"""Reasoning parsers (`--reasoning-parser`): split a reasoning model's `<think>...</think>`
section from its answer. The server uses them for `reasoning_content` (whole texts and streamed
deltas); the engine core uses their end marker so that structured output constrains only what
follows the reasoning section."""

from __future__ import annotations

from minivllm.reasoning.base import ReasoningParser, ReasoningStream
from minivllm.reasoning.parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}")
    return REASONING_PARSERS[name]()


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]
