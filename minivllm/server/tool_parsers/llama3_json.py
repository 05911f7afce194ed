"""Llama 3.x JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several calls separated by `;`. Output that does not start with `{` is content."""

from __future__ import annotations

import json

from minivllm.server.tool_parsers.base import (
    ParsedToolCall,
    ToolCallParser,
    ToolEvent,
    ToolStream,
    call_from_object,
)

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _objects(text: str) -> tuple[list[object], int]:
    """The JSON values at the start of text, separated by whitespace or `;`, and where the
    first incomplete (or non-JSON) part starts."""
    out, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos >= len(text):
            return out, pos
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out, pos
        out.append(obj)
        pos = end


def _body(text: str) -> str | None:
    """The call text after an optional python tag, or None if the output is not calls."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    return body if body.startswith("{") else None


class Llama3JsonToolParser(ToolCallParser):
    name = "llama3_json"

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        body = _body(text)
        if body is None:
            return text, []
        objs, end = _objects(body)
        calls = [call_from_object(o) for o in objs]
        if not calls or any(c is None for c in calls) or body[end:].strip():
            return text, []
        return None, calls

    def stream(self) -> ToolStream:
        return _Llama3Stream()


class _Llama3Stream(ToolStream):
    """Decides on the first characters whether the output is calls; then emits each call as
    its object completes."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "start"  # start | calls | content
        self.done = 0  # characters of the call text already parsed into calls

    def feed(self, delta: str) -> list[ToolEvent]:
        self.buf += delta
        if self.mode == "start":
            head = self.buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return []  # not decided yet
            self.mode = "calls" if _body(self.buf) is not None or head.startswith(PYTHON_TAG) else "content"
        if self.mode == "content":
            text, self.buf = self.buf, ""
            return [ToolEvent("content", text)] if text else []
        return self._calls()

    def _calls(self) -> list[ToolEvent]:
        body = _body(self.buf)
        if body is None:
            return []
        objs, end = _objects(body[self.done:])
        events = []
        for o in objs:
            call = call_from_object(o)
            if call is not None:
                events.append(ToolEvent("call", call=call))
        self.done += end
        return events

    def finish(self) -> list[ToolEvent]:
        if self.mode != "calls":
            text, self.buf = self.buf, ""
            return [ToolEvent("content", text)] if text else []
        body = _body(self.buf) or ""
        rest = body[self.done:].strip()
        return [ToolEvent("content", rest)] if rest else []
