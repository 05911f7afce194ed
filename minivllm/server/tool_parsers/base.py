"""The tool-call parser interface and what the parsers share (a call object -> name and
arguments, held-back marker prefixes)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class ToolEvent:
    """One step of a streamed parse: content text, a complete call, or (named tool_choice) a
    piece of the single call's arguments."""

    kind: str  # "content" | "call" | "args"
    text: str = ""
    call: ParsedToolCall | None = None


class ToolStream:
    """Incremental parse of one choice's text: feed() each delta, finish() at the end."""

    def feed(self, delta: str) -> list[ToolEvent]:
        raise NotImplementedError

    def finish(self) -> list[ToolEvent]:
        return []


class ToolCallParser:
    name = "base"

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a whole output; no calls (and all text as content) when the text
        holds no well-formed call."""
        raise NotImplementedError

    def stream(self) -> ToolStream:
        raise NotImplementedError


def call_from_object(obj: Any) -> ParsedToolCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} -> a call, or None if not that shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_call(text: str) -> ParsedToolCall | None:
    try:
        return call_from_object(json.loads(text))
    except json.JSONDecodeError:
        return None


def marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
