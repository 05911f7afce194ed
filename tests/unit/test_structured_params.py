"""StructuredOutputsParams and the checks made before a grammar compiles: one constraint kind,
JSON Schema validity, keywords a grammar cannot enforce (named with their location), regex and
EBNF errors with the position, Lark grammars converted to EBNF, choices escaped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minivllm import SamplingParams, StructuredOutputsParams
from minivllm.structured.backend import grammar_key
from minivllm.structured.json_schema import check_schema, forbid_additional_properties
from minivllm.structured.lark import is_lark, lark_to_ebnf

xgr = pytest.importorskip("xgrammar")
from minivllm.structured.xgrammar_backend import XgrammarBackend  # noqa: E402

SCHEMAS = Path(__file__).resolve().parents[2] / "minivllm" / "bench" / "schemas"


def test_exactly_one_kind():
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="structured_outputs.choice conflicts.*regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs.choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.choice must hold strings"):
        StructuredOutputsParams(choice=["a", 3])
    with pytest.raises(ValueError, match="structured_outputs.regex must be a non-empty string"):
        StructuredOutputsParams(regex="")
    with pytest.raises(ValueError, match="structured_outputs.json must be a JSON Schema"):
        StructuredOutputsParams(json=3)
    with pytest.raises(ValueError, match="structured_outputs.nope is not a field"):
        StructuredOutputsParams.from_dict({"nope": 1})


def test_sampling_params_carry_and_clone_the_constraint():
    so = StructuredOutputsParams(choice=["x", "y"])
    p = SamplingParams(n=2, structured_outputs=so)
    assert p.clone().structured_outputs == so
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_grammar_key_separates_options():
    a = grammar_key(StructuredOutputsParams(json={"type": "object"}))
    b = grammar_key(StructuredOutputsParams(json='{"type": "object"}'))
    c = grammar_key(StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True))
    assert a == b and a != c and a.kind == "json"


@pytest.mark.parametrize("path", sorted(SCHEMAS.glob("*.json")), ids=lambda p: p.stem)
def test_fixture_schemas_pass_except_unique_items(path):
    schema = json.loads(path.read_text())["schema"]
    so = StructuredOutputsParams(json=schema)
    if path.stem == "config_tree":  # its tags are uniqueItems: a grammar cannot enforce that
        with pytest.raises(ValueError, match="'uniqueItems' at #/properties/tags"):
            XgrammarBackend.validate(so)
    else:
        XgrammarBackend.validate(so)


@pytest.mark.parametrize("schema,pattern", [
    ({"type": "foo"}, "not a valid JSON Schema"),
    ({"type": "object", "required": "name"}, "not a valid JSON Schema.*at required"),
    ({"type": "integer", "multipleOf": 3}, "'multipleOf' at #"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' at #/properties/a"),
    ({"$defs": {"x": {"type": "array", "contains": {"type": "integer"}}}, "$ref": "#/$defs/x"},
     "'contains' at #/\\$defs/x"),
    ({"type": "string", "format": "credit-card"}, "format 'credit-card'"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "pattern or format with minLength/maxLength"),
    ({"anyOf": [{"type": "integer"}, {"allOf": [{"type": "string"}]}]}, "'allOf' at #/anyOf/1"),
    ({"$ref": "#/$defs/missing"}, "does not compile: .*missing"),
])
def test_bad_schemas_are_named(schema, pattern):
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs.json .*" + pattern):
        XgrammarBackend.validate(StructuredOutputsParams(json=schema))


def test_a_property_named_like_a_keyword_is_fine():
    check_schema({"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}})


def test_invalid_json_text():
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        XgrammarBackend.validate(StructuredOutputsParams(json="{not json"))


@pytest.mark.parametrize("kind,value,pattern", [
    ("regex", "a(b", "position 4"),
    ("regex", "[a-", "position"),
    ("grammar", 'root ::= "a" | ', "line 1, column"),
    ("grammar", "root ::= foo", 'Rule "foo" is not defined'),
    ("grammar", "start: a\na: /[0-9]+/", "line 2: regular-expression terminals"),
    ("structural_tag", "{bad", "not valid JSON"),
])
def test_syntax_errors_give_the_position(kind, value, pattern):
    with pytest.raises(ValueError, match=f"SamplingParams.structured_outputs.{kind} .*{pattern}"):
        XgrammarBackend.validate(StructuredOutputsParams(**{kind: value}))


def test_forbid_additional_properties_only_where_unset():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "object", "properties": {}, "additionalProperties": True}}}
    out = forbid_additional_properties(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is left alone


LARK_ARITH = """
// a small arithmetic grammar
?start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER
      | "(" expr ")"
NUMBER: DIGIT ~ 1..3
DIGIT: "0".."9"
"""


def _accepts(ebnf: str, text: str) -> bool:
    m = xgr.GrammarMatcher(_compile(ebnf))
    return m.accept_string(text) and m.is_completed()


def _compile(ebnf: str):
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])  # one token per printable character
    return xgr.GrammarCompiler(info).compile_grammar(ebnf)


def test_lark_to_ebnf():
    assert is_lark(LARK_ARITH) and not is_lark('root ::= "a"')
    ebnf = lark_to_ebnf(LARK_ARITH)
    assert ebnf.startswith("root ::= expr") and 'NUMBER ::= DIGIT{1,3}' in ebnf and "[0-9]" in ebnf
    for good in ["1+2*3", "(12-3)/4", "999"]:
        assert _accepts(ebnf, good), good
    for bad in ["1+", "1234", "(1"]:
        assert not _accepts(ebnf, bad), bad


def test_lark_optional_and_quotes():
    ebnf = lark_to_ebnf("start: 'say' [\" \" WORD]\nWORD: \"hi\" | 'it\\'s'")
    assert _accepts(ebnf, "say") and _accepts(ebnf, "say hi") and _accepts(ebnf, "say it's")
    with pytest.raises(ValueError, match="no `start` rule"):
        lark_to_ebnf("a: \"x\"")
    with pytest.raises(ValueError, match="line 1: the directive '%import'"):
        lark_to_ebnf("%import common.NUMBER\nstart: NUMBER")


def test_choice_is_escaped():
    from minivllm.structured.xgrammar_backend import _ebnf
    choices = ['say "hi"', "back\\slash", "été", "a\nb"]
    ebnf = _ebnf(choices, "choice")
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["é", "\n"])
    g = xgr.GrammarCompiler(info).compile_grammar(ebnf)
    for c in choices:
        m = xgr.GrammarMatcher(g)
        assert m.accept_string(c) and m.is_completed(), c
    m = xgr.GrammarMatcher(g)
    assert not m.accept_string('say "ho"')


def test_required_tool_calls_schema_hoists_defs():
    """tool_choice="required": an array of {name, parameters} whose parameters follow the named
    tool's schema; each tool's $defs move to the top, where its refs point."""
    import jsonschema

    from minivllm.server.protocol import ChatCompletionRequest
    from minivllm.server.tools import ToolMode, tool_constraint
    city = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    tools = [{"type": "function", "function": {"name": "a", "parameters": {
                 "type": "object", "properties": {"c": {"$ref": "#/$defs/City"}}, "required": ["c"],
                 "$defs": {"City": city}}}},
             {"type": "function", "function": {"name": "b"}}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice="required")
    c = tool_constraint(req, ToolMode("required", parallel=False))
    schema = c.params.json
    assert schema["$defs"] == {"City": city} and schema["maxItems"] == 1
    XgrammarBackend.validate(c.params)
    jsonschema.validate([{"name": "a", "parameters": {"c": {"name": "Paris"}}}], schema)
    for bad in ([], [{"name": "a", "parameters": {"c": {}}}], [{"name": "c", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
