"""A chat choice's text -> the assistant message: reasoning_content (with --reasoning-parser),
content and tool_calls, for whole outputs (message) and streamed ones (ChoiceStream deltas).
The reasoning section is split off first; tools then see only the answer."""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.reasoning import ReasoningParser
from minivllm.server.tool_parsers import ToolEvent
from minivllm.server.tools import ToolMode, call_dict, calls_of_output, new_call_id, tool_stream


@dataclass
class ChatOutputOptions:
    reasoning: ReasoningParser | None
    tools: ToolMode


def finish_reason_of(opts: ChatOutputOptions, finish_reason: str | None, called: bool) -> str | None:
    """"tool_calls" when the model called tools it chose (auto) or had to call (required)."""
    if called and opts.tools.kind in ("auto", "required") and finish_reason == "stop":
        return "tool_calls"
    return finish_reason


def message(opts: ChatOutputOptions, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """(assistant message, finish_reason) of a whole output."""
    reasoning, content = opts.reasoning.split(text) if opts.reasoning is not None else (None, text)
    calls = []
    if opts.tools.kind != "none":
        content, calls = calls_of_output(opts.tools, content or "")
    msg = {"role": "assistant", "content": content}
    if opts.reasoning is not None:
        msg["reasoning_content"] = reasoning
    msg["tool_calls"] = [call_dict(c) for c in calls]
    return msg, finish_reason_of(opts, finish_reason, bool(calls))


@dataclass
class ChoiceStream:
    """One streamed choice: delta(text) -> the chunk's delta fields ({} if nothing to send)."""

    opts: ChatOutputOptions
    num_calls: int = 0
    _reasoning: object = field(default=None, repr=False)
    _tools: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.opts.reasoning is not None:
            self._reasoning = self.opts.reasoning.stream()
        self._tools = tool_stream(self.opts.tools)

    def delta(self, text: str) -> dict:
        reasoning, content = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        return self._build(reasoning, self._tools.feed(content) if self._tools is not None else _plain(content))

    def finish(self) -> dict:
        """The held-back rest, once the choice has finished."""
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        events = self._tools.feed(content) if self._tools is not None else _plain(content)
        if self._tools is not None:
            events += self._tools.finish()
        return self._build(reasoning, events)

    def _build(self, reasoning: str, events: list[ToolEvent]) -> dict:
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        content = "".join(e.text for e in events if e.kind == "content")
        if content:
            out["content"] = content
        calls = [c for e in events if (c := self._call_delta(e)) is not None]
        if calls:
            out["tool_calls"] = calls
        return out

    def _call_delta(self, e: ToolEvent) -> dict | None:
        if e.kind == "call":
            if self.num_calls > 0 and not self.opts.tools.parallel:
                return None
            self.num_calls += 1
            return call_dict(e.call, self.num_calls - 1)
        if e.kind == "args":  # named tool_choice: the first piece opens the call
            if self.num_calls == 0:
                self.num_calls = 1
                return {"index": 0, "id": new_call_id(), "type": "function",
                        "function": {"name": self.opts.tools.name, "arguments": e.text}}
            return {"index": 0, "function": {"arguments": e.text}}
        return None


def _plain(text: str) -> list[ToolEvent]:
    return [ToolEvent("content", text)] if text else []
