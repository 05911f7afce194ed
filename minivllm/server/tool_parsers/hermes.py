"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call; the text before the first block is the message content."""

from __future__ import annotations

import re

from minivllm.server.tool_parsers.base import (
    ParsedToolCall,
    ToolCallParser,
    ToolEvent,
    ToolStream,
    marker_prefix_len,
    parse_call,
)

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


class HermesToolParser(ToolCallParser):
    name = "hermes"

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        if START not in text:
            return text, []
        calls = []
        for m in _BLOCK.finditer(text):
            call = parse_call((m.group(1) if m.group(1) is not None else m.group(2)).strip())
            if call is None:
                return text, []  # a malformed block: leave the text as it is
            calls.append(call)
        content = text[:text.index(START)]
        return (content if content.strip() else None), calls

    def stream(self) -> ToolStream:
        return _HermesStream()


class _HermesStream(ToolStream):
    """Content streams until `<tool_call>`; each block becomes one call event when it closes.
    After the first call only calls are emitted (as extract() keeps only the leading content)."""

    def __init__(self) -> None:
        self.buf = ""
        self.in_call = False
        self.num_calls = 0

    def feed(self, delta: str) -> list[ToolEvent]:
        self.buf += delta
        events: list[ToolEvent] = []
        while True:
            if not self.in_call:
                i = self.buf.find(START)
                if i < 0:
                    keep = marker_prefix_len(self.buf, START)
                    self._content(events, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return events
                self._content(events, self.buf[:i])
                self.buf, self.in_call = self.buf[i + len(START):], True
            j = self.buf.find(END)
            if j < 0:
                return events
            self._call(events, self.buf[:j])
            self.buf, self.in_call = self.buf[j + len(END):], False

    def finish(self) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self.in_call:  # a block left open at the end, as extract() reads it
            if not self._call(events, self.buf):
                events.append(ToolEvent("content", START + self.buf))
        else:
            self._content(events, self.buf)
        self.buf = ""
        return events

    def _content(self, events: list[ToolEvent], text: str) -> None:
        if text and self.num_calls == 0:
            events.append(ToolEvent("content", text))

    def _call(self, events: list[ToolEvent], body: str) -> bool:
        call = parse_call(body.strip())
        if call is None:
            events.append(ToolEvent("content", START + body + END))
            return False
        self.num_calls += 1
        events.append(ToolEvent("call", call=call))
        return True
