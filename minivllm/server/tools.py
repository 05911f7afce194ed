"""Tool calling as vLLM does it.

- tool_choice "none": the tools go to the chat template, the output is plain content.
- a named function: the output is constrained to that function's `parameters` schema and
  becomes the arguments of one call (finish_reason "stop", as OpenAI reports a forced call).
- "required": the output is constrained to a JSON array of {"name", "parameters"} objects
  whose parameters validate against the named tool's schema; it becomes the calls
  (finish_reason "tool_calls"); parallel_tool_calls=false allows one.
- "auto" (the default when tools are given): needs `--enable-auto-tool-choice
  --tool-call-parser NAME`; the parser finds calls in the model's free text (finish_reason
  "tool_calls" when it found some).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.server.errors import bad_request
from minivllm.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from minivllm.server.structured import Constraint
from minivllm.server.tool_parsers import ParsedToolCall, ToolEvent, ToolStream, get_tool_parser
from minivllm.server.tool_parsers.base import call_from_object

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolMode:
    """How a chat request's output relates to its tools."""

    kind: str  # none | named | required | auto
    name: str | None = None  # named: the forced function
    parser: str | None = None  # auto: the tool-call parser's name
    parallel: bool = True


def resolve_tool_mode(req: ChatCompletionRequest, enable_auto: bool, parser: str | None) -> ToolMode:
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    if choice != "none" and not req.tools:
        raise bad_request(f"tool_choice {_choice_name(choice)!r} needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in req.tools]
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                              f"({', '.join(names)})", "tool_choice")
        return ToolMode("named", name=choice.function.name)
    if choice == "auto" and not (enable_auto and parser):
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                          "tool_choice")
    return ToolMode(choice, parser=parser if choice == "auto" else None, parallel=req.parallel_tool_calls)


def _choice_name(choice) -> str:
    return choice.function.name if isinstance(choice, NamedToolChoice) else choice


def tool_constraint(req: ChatCompletionRequest, mode: ToolMode) -> Constraint | None:
    """The output constraint of a forced call (named or required)."""
    if mode.kind == "named":
        tool = next(t for t in req.tools if t.function.name == mode.name)
        schema = tool.function.parameters or _ANY_OBJECT
        return Constraint("tools", f"the parameters of tool {mode.name!r}", StructuredOutputsParams(json=schema))
    if mode.kind == "required":
        return Constraint("tools", "the tools' parameters", StructuredOutputsParams(json=_calls_schema(req.tools, mode)))
    return None


def _calls_schema(tools: list[Tool], mode: ToolMode) -> dict:
    """[{"name": <one tool>, "parameters": <its schema>}, ...]: one or more calls (one if not
    parallel). Each tool's $defs move to the top, where its "#/$defs/..." refs point."""
    defs: dict[str, Any] = {}
    variants = []
    for t in tools:
        params = dict(t.function.parameters or _ANY_OBJECT)
        for name, sub in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != sub:
                raise bad_request(f"tools define $defs/{name} twice with different schemas", "tools")
            defs[name] = sub
        variants.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                          "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not mode.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_dict(call: ParsedToolCall, index: int | None = None) -> dict:
    d = {"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return d if index is None else {"index": index, **d}


def calls_of_output(mode: ToolMode, text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a whole output under the request's tool mode."""
    if mode.kind == "named":
        return None, [ParsedToolCall(mode.name, text)]
    if mode.kind == "required":
        calls = _required_calls(text)
        return (text, []) if calls is None else (None, calls[:1] if not mode.parallel else calls)
    if mode.kind == "auto":
        content, calls = get_tool_parser(mode.parser).extract(text)
        return content, calls[:1] if not mode.parallel else calls
    return text, []


def _required_calls(text: str) -> list[ParsedToolCall] | None:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None  # cut short (max_tokens): the text stays content
    calls = [call_from_object(o) for o in items] if isinstance(items, list) else [None]
    return None if any(c is None for c in calls) else calls


def tool_stream(mode: ToolMode) -> ToolStream | None:
    """The incremental parser of a streamed choice (None: plain content)."""
    if mode.kind == "named":
        return _NamedStream()
    if mode.kind == "required":
        return _RequiredStream()
    if mode.kind == "auto":
        return get_tool_parser(mode.parser).stream()
    return None


class _NamedStream(ToolStream):
    """The constrained output is the arguments: each delta is a piece of them."""

    def feed(self, delta: str) -> list[ToolEvent]:
        return [ToolEvent("args", delta)] if delta else []


class _RequiredStream(ToolStream):
    """The constrained output is a JSON array of calls: each call is emitted when its object
    completes."""

    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0  # where the next element starts (after "[" or ",")
        self._decoder = json.JSONDecoder()

    def feed(self, delta: str) -> list[ToolEvent]:
        self.buf += delta
        events = []
        while True:
            start = self._skip(self.pos)
            if start >= len(self.buf):
                return events
            try:
                obj, end = self._decoder.raw_decode(self.buf, start)
            except json.JSONDecodeError:
                return events
            call = call_from_object(obj)
            if call is not None:
                events.append(ToolEvent("call", call=call))
            self.pos = end

    def _skip(self, pos: int) -> int:
        while pos < len(self.buf) and self.buf[pos] in " \t\r\n[,":
            pos += 1
        return pos
