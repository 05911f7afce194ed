"""A request's constraint fields -> StructuredOutputsParams, checked here so that a bad one is a
400 naming the field the client used (the engine checks again for the offline API).

Sources, at most one per request: OpenAI's `response_format` (json_object, json_schema),
vLLM's `structured_outputs` object, its legacy `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`, and (chat) a tool_choice that forces a call (tools.py).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.server.errors import OpenAIError, bad_request
from minivllm.server.protocol import SamplingFields
from minivllm.structured.backend import validate_spec

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass
class Constraint:
    param: str  # the request field it came from (the 400's `param`)
    label: str  # how messages name it, e.g. "response_format.json_schema.schema"
    params: StructuredOutputsParams


def requested_constraints(req: SamplingFields) -> list[Constraint]:
    """Every constraint the request's fields set (more than one is refused by single_constraint)."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        label = "response_format.json_schema.schema" if rf.type == "json_schema" else "response_format"
        found.append(Constraint("response_format", label, _from_response_format(rf)))
    if req.structured_outputs is not None:
        so = _build("structured_outputs", None,
                    lambda: StructuredOutputsParams.from_dict(req.structured_outputs))
        found.append(Constraint("structured_outputs", "structured_outputs." + so.kind, so))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            so = _build(name, name, lambda k=kind, v=value: StructuredOutputsParams(**{k: v}))
            found.append(Constraint(name, name, so))
    return found


def single_constraint(found: list[Constraint]) -> Constraint | None:
    if len(found) > 1:
        names = [c.param for c in found]
        raise bad_request(f"give at most one output constraint; this request sets {', '.join(names)}", names[1])
    return found[0] if found else None


def check_constraint(c: Constraint, backend: str) -> None:
    """The backend's compile checks (schema validity, unsupported features, regex/grammar syntax
    with the position), once per spec (validate_spec): a 400 naming the request's field."""
    try:
        validate_spec(backend, c.params)
    except ValueError as e:
        raise bad_request(_rename(str(e), c.label), c.param) from None


async def resolve_constraint(req: SamplingFields, backend: str,
                             extra: Constraint | None = None) -> StructuredOutputsParams | None:
    """The request's one constraint (from its fields, or `extra`: a forced tool call), checked on a
    worker thread: a spec not seen before costs the JSON Schema meta-validation and a grammar
    build (milliseconds, more for a large schema), which on the event loop would stall every
    stream the server is sending."""
    c = single_constraint(requested_constraints(req) + ([extra] if extra is not None else []))
    if c is None:
        return None
    await asyncio.to_thread(check_constraint, c, backend)
    return c.params


def _from_response_format(rf) -> StructuredOutputsParams:
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
    schema = rf.json_schema.json_schema
    if isinstance(schema, bool):
        raise bad_request("response_format.json_schema.schema must be a JSON Schema object", "response_format")
    return StructuredOutputsParams(json=schema)


def _build(param: str, label: str | None, make) -> StructuredOutputsParams:
    try:
        return make()
    except (ValueError, TypeError) as e:
        raise bad_request(_rename(str(e), label), param) from None


def _rename(msg: str, label: str | None) -> str:
    """The engine's "SamplingParams.structured_outputs.<kind> ..." as "<label> ..." (None:
    "structured_outputs.<kind> ...")."""
    if label is None:
        return msg.replace("SamplingParams.", "", 1)
    return re.sub(r"SamplingParams\.structured_outputs(\.\w+)?", label, msg, count=1)


__all__ = ["Constraint", "OpenAIError", "check_constraint", "requested_constraints", "resolve_constraint",
           "single_constraint"]
