"""JSON Schema checks before compiling: the schema must be valid JSON Schema (the `jsonschema`
package's meta-schema check), and every keyword that constrains output must be one a grammar can
enforce. A keyword the grammar would silently drop (uniqueItems, multipleOf, not, ...) is refused
with its location, instead of producing output that fails validation."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

# keywords a token grammar cannot enforce (xgrammar ignores them or supports only part)
UNSUPPORTED = {
    "uniqueItems": "items cannot be compared with each other while they are generated",
    "contains": "an array that must contain a match is not supported",
    "minContains": "an array that must contain a match is not supported",
    "maxContains": "an array that must contain a match is not supported",
    "multipleOf": "divisibility cannot be expressed as a grammar",
    "not": "negated schemas are not supported",
    "if": "conditional schemas are not supported",
    "then": "conditional schemas are not supported",
    "else": "conditional schemas are not supported",
    "allOf": "schema intersection is not supported (merge the schemas into one)",
    "dependentRequired": "dependencies between properties are not supported",
    "dependentSchemas": "dependencies between properties are not supported",
    "dependencies": "dependencies between properties are not supported",
    "unevaluatedItems": "unevaluatedItems is not supported",
    "$dynamicRef": "$dynamicRef is not supported",
}
# string formats xgrammar turns into a grammar
SUPPORTED_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                     "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
# keywords whose value is a subschema, a list of them, or a map name -> subschema
_ONE = ("items", "additionalProperties", "propertyNames", "additionalItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def parse_schema(value: str | dict) -> dict | bool:
    """The schema as an object; a ValueError naming the field if the text is not JSON."""
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"SamplingParams.structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"SamplingParams.structured_outputs.json must be a JSON object, got {type(schema).__name__}")
    return schema


def check_schema(schema: dict | bool) -> None:
    """ValueError unless `schema` is valid JSON Schema that a grammar can enforce whole."""
    import jsonschema
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(f"SamplingParams.structured_outputs.json is not a valid JSON Schema: {e.message} "
                         f"(at {where})") from None
    for path, sub in _subschemas(schema, "#"):
        _check_keywords(path, sub)


def _check_keywords(path: str, schema: dict) -> None:
    for key, why in UNSUPPORTED.items():
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            raise ValueError(f"SamplingParams.structured_outputs.json uses {key!r} at {path}, which structured "
                             f"outputs do not support: {why}")
    fmt = schema.get("format")
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        raise ValueError(f"SamplingParams.structured_outputs.json uses format {fmt!r} at {path}, which structured "
                         f"outputs do not support (supported: {', '.join(sorted(SUPPORTED_FORMATS))})")
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        raise ValueError(f"SamplingParams.structured_outputs.json combines a pattern or format with "
                         f"minLength/maxLength at {path}, which structured outputs do not support: put the "
                         f"length into the pattern")


def _subschemas(schema: Any, path: str) -> Iterator[tuple[str, dict]]:
    """Every (JSON pointer, schema object) reachable through the subschema keywords."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _ONE:
        yield from _subschemas(schema.get(key), f"{path}/{key}")
    for key in _LIST:
        for i, sub in enumerate(schema.get(key) or []):
            yield from _subschemas(sub, f"{path}/{key}/{i}")
    for key in _MAP:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield from _subschemas(sub, f"{path}/{key}/{name}")


def forbid_additional_properties(schema: dict | bool) -> dict | bool:
    """A copy where every object schema with `properties` and no `additionalProperties` gets
    `additionalProperties: false` (StructuredOutputsParams.disable_additional_properties)."""
    out = copy.deepcopy(schema)
    for _, sub in _subschemas(out, "#"):
        if "properties" in sub and "additionalProperties" not in sub:
            sub["additionalProperties"] = False
    return out
