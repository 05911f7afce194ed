"""Tool-call parsers (`minivllm serve --enable-auto-tool-choice --tool-call-parser NAME`): they
find the calls in a model's text, whole (extract) or while it streams (stream)."""

from __future__ import annotations

from minivllm.server.tool_parsers.base import ParsedToolCall, ToolCallParser, ToolEvent, ToolStream
from minivllm.server.tool_parsers.hermes import HermesToolParser
from minivllm.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolCallParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ParsedToolCall", "ToolCallParser", "ToolEvent", "ToolStream", "get_tool_parser"]
