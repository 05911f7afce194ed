"""Structured outputs, tool calling and reasoning through the OpenAI-compatible server, with the
official `openai` client.

- `served`: the engine core in its own process (the server's default: the constraints cross the
  pipe and compile there), `--enable-auto-tool-choice --tool-call-parser hermes`.
- `scripted`: an in-process engine with `--reasoning-parser qwen3` whose first sampled tokens
  are forced by the test (a marker in the prompt picks the text), so that tool_choice "auto"
  and the reasoning split run the real parsers on a known output; tokens after the forced ones
  are sampled (and constrained) as usual.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest

from minivllm import LLM
from minivllm.core.interfaces import RunnerOutput
from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.mp_async_engine import MPAsyncEngine
from minivllm.server.app import create_app
from minivllm.server.serving_common import ServerSettings
from minivllm.server.testing import ServerThread

pytest.importorskip("xgrammar")

SCHEMAS = Path(__file__).resolve().parents[2] / "minivllm" / "bench" / "schemas"
ENGINE_KW = dict(dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_bytes=256 << 20)
WEATHER = json.loads((SCHEMAS / "weather_call.json").read_text())
PERSON = json.loads((SCHEMAS / "person.json").read_text())
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER["schema"]}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": WEATHER["prompt"]}]


@dataclass
class Served:
    base_url: str
    model: str
    client: openai.OpenAI


def _serve(engine):
    """A server over `engine` with tool_choice "auto" on (hermes); stops both at the end."""
    server = ServerThread(create_app(engine, ServerSettings(own_engine=False, enable_auto_tool_choice=True,
                                                            tool_call_parser="hermes"))).start()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        yield Served(server.base_url, engine.config.model.served_name, client)
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def served():
    yield from _serve(MPAsyncEngine.from_kwargs(**ENGINE_KW))


# ---- response_format / structured_outputs / guided_* ------------------------------------------
def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def test_json_schema_stream_and_not(served):
    c, m = served.client, served.model
    msgs = [{"role": "user", "content": PERSON["prompt"]}]
    r = c.chat.completions.create(model=m, messages=msgs, max_tokens=80, temperature=0.8, seed=1,
                                  response_format=_schema_format(PERSON["schema"]))
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON["schema"])
    chunks = list(c.chat.completions.create(model=m, messages=msgs, max_tokens=80, temperature=0.8, seed=1, stream=True,
                                            response_format=_schema_format(PERSON["schema"])))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content  # same seed: streaming changes nothing


def test_json_object_and_parse_with_pydantic(served):
    c, m = served.client, served.model
    r = c.chat.completions.create(model=m, messages=ASK, max_tokens=60, temperature=0,
                                  response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)

    class Forecast(pydantic.BaseModel):
        city: str
        days: int

    parsed = c.beta.chat.completions.parse(model=m, messages=ASK, max_tokens=60, temperature=0,
                                           response_format=Forecast)
    assert isinstance(parsed.choices[0].message.parsed, Forecast)


def test_n_logprobs_and_stop_with_a_schema(served):
    r = served.client.chat.completions.create(
        model=served.model, messages=ASK, max_tokens=60, temperature=1.0, seed=3, n=2, logprobs=True, top_logprobs=2,
        response_format=_schema_format(WEATHER["schema"]))
    assert len(r.choices) == 2
    for ch in r.choices:
        assert ch.logprobs.content and all(t.logprob > -9999.0 for t in ch.logprobs.content)
        if ch.finish_reason == "stop":
            jsonschema.validate(json.loads(ch.message.content), WEATHER["schema"])
    r = served.client.chat.completions.create(model=served.model, messages=ASK, max_tokens=60, temperature=0,
                                              stop=['"unit"'], response_format=_schema_format(WEATHER["schema"]))
    assert r.choices[0].finish_reason == "stop" and '"unit"' not in r.choices[0].message.content


def test_completions_endpoint_forms(served):
    c, m = served.client, served.model
    r = c.completions.create(model=m, prompt="Phone number:", max_tokens=16, temperature=0.7, seed=0, n=2,
                             extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert all(re.fullmatch(r"\d{3}-\d{4}", ch.text) for ch in r.choices)
    r = c.completions.create(model=m, prompt="Pick a colour:", max_tokens=8, temperature=0,
                             extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert r.choices[0].text in ("red", "blue")
    chunks = list(c.completions.create(model=m, prompt="Weather request as JSON:", max_tokens=60, temperature=0,
                                       stream=True, extra_body={"guided_json": WEATHER["schema"]}))
    jsonschema.validate(json.loads("".join(ch.choices[0].text for ch in chunks)), WEATHER["schema"])
    r = c.completions.create(model=m, prompt="JSON:", max_tokens=40, temperature=0,
                             extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.startswith("{")
    if r.choices[0].finish_reason == "stop":  # (the model may fill a string until max_tokens)
        assert isinstance(json.loads(r.choices[0].text), dict)
    r = c.completions.create(model=m, prompt="Sum:", max_tokens=12, temperature=0,
                             extra_body={"guided_grammar": 'root ::= [1-9] " + " [1-9]'})
    assert re.fullmatch(r"[1-9] \+ [1-9]", r.choices[0].text)


# ---- tools --------------------------------------------------------------------------------------
def test_tool_choice_required(served):
    c, m = served.client, served.model
    r = c.chat.completions.create(model=m, messages=ASK, max_tokens=80, temperature=0, tools=TOOLS,
                                  tool_choice="required", parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1 and ch.message.content is None
    call = ch.message.tool_calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    chunks = list(c.chat.completions.create(model=m, messages=ASK, max_tokens=80, temperature=0, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False, stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == [call.function.name]
    assert json.loads(calls[0].function.arguments) == json.loads(call.function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_named(served):
    c, m = served.client, served.model
    named = {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(model=m, messages=ASK, max_tokens=40, temperature=0, tools=TOOLS, tool_choice=named)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])
    chunks = list(c.chat.completions.create(model=m, messages=ASK, max_tokens=40, temperature=0, tools=TOOLS,
                                            tool_choice=named, stream=True))
    pieces = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == "get_time" and pieces[0].id
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments


def test_tool_messages_render_through_the_template(served):
    """The template gets the assistant's tool_calls (arguments as an object) and the tool's
    answer; a template that renders them (Qwen2.5-style) shows both in the prompt."""
    from minivllm.server.protocol import ChatMessage
    from minivllm.server.serving_chat import message_dicts
    msgs = [ChatMessage(**m) for m in [
        *ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]]
    dicts = message_dicts(msgs)
    assert dicts[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert dicts[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    r = httpx.post(served.base_url + "/tokenize", json={"messages": [m.model_dump(exclude_none=True) for m in msgs],
                                                        "tools": TOOLS})
    assert r.status_code == 200, r.text  # the default template renders the conversation without failing
    r = served.client.chat.completions.create(model=served.model, messages=[m.model_dump(exclude_none=True)
                                                                            for m in msgs], max_tokens=8, temperature=0)
    assert r.choices[0].message.content is not None


# ---- bad input ----------------------------------------------------------------------------------
BAD = [
    ({"response_format": _schema_format({"type": "foo"})}, "response_format", "not a valid JSON Schema"),
    ({"response_format": _schema_format({"type": "array", "items": {"type": "string"}, "uniqueItems": True})},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_regex": "a(b"}, "guided_regex", "position 4"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "line 1, column"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "at most one"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tools", "at most one"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools", "not a valid JSON Schema"),
]


def test_a_slow_schema_check_does_not_stall_the_server(served, monkeypatch):
    """The server checks a constraint on a worker thread: while a new schema's check runs (made
    to take 1.5 s here), the event loop answers other requests at once."""
    import threading
    import time

    from minivllm.structured import xgrammar_backend
    real = xgrammar_backend.XgrammarBackend.validate

    def slow(so):
        if isinstance(so.json, dict) and so.json.get("title") == "slow-check":
            time.sleep(1.5)
        return real(so)
    monkeypatch.setattr(xgrammar_backend.XgrammarBackend, "validate", staticmethod(slow))
    body = {"model": served.model, "prompt": "x", "max_tokens": 2,
            "guided_json": {"title": "slow-check", "type": "object", "properties": {"a": {"type": "integer"}}}}
    done = {}
    worker = threading.Thread(target=lambda: done.update(r=httpx.post(served.base_url + "/v1/completions",
                                                                        json=body, timeout=120)))
    worker.start()
    time.sleep(0.3)  # the constrained request is in its check now
    t = time.perf_counter()
    assert httpx.get(served.base_url + "/health", timeout=30).status_code == 200
    waited = time.perf_counter() - t
    worker.join(120)
    assert done["r"].status_code == 200, done["r"].text
    assert waited < 0.6, f"/health waited {waited:.2f} s behind the schema check"


@pytest.mark.parametrize("patch,param,words", BAD, ids=[p for _, p, _ in BAD])
def test_bad_input_is_400_and_the_server_goes_on(served, patch, param, words):
    body = {"model": served.model, "messages": ASK, "max_tokens": 4, **patch}
    r = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error", err
    ok = served.client.completions.create(model=served.model, prompt="Hi", max_tokens=2, temperature=0,
                                          extra_body={"guided_choice": ["yes", "no"]})
    assert ok.choices[0].text in ("yes", "no")


def test_auto_needs_the_server_flags():
    from minivllm.server.protocol import ChatCompletionRequest
    from minivllm.server.tools import resolve_tool_mode
    from minivllm.server.errors import OpenAIError
    req = ChatCompletionRequest(messages=ASK, tools=TOOLS)  # tool_choice defaults to "auto"
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice"):
        resolve_tool_mode(req, False, None)
    assert resolve_tool_mode(req, True, "hermes").kind == "auto"
    assert resolve_tool_mode(ChatCompletionRequest(messages=ASK), False, None).kind == "none"


# ---- scripted outputs: tool_choice auto and the reasoning split ---------------------------------
CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
SCRIPTS = {"SCRIPT:call": (CALL_TEXT, True), "SCRIPT:think": ("<think>\nPlanning a JSON answer.\n", False)}


def _force_prefixes(llm: LLM) -> None:
    """The first sampled tokens of a request whose prompt holds a SCRIPTS marker become that
    text (+ eos, or + "</think>" as its own tokens); later tokens are the engine's own."""
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    real_finish, forced = engine.executor.finish, {}

    def script_for(rid: str) -> list[int]:
        if rid not in forced:
            prompt = tok.decode(engine.scheduler.requests[rid].prompt_token_ids)
            key = next((k for k in SCRIPTS if k in prompt), None)
            ids = []
            if key is not None:
                text, eos = SCRIPTS[key]
                ids = tok.encode(text, add_special_tokens=False)
                ids += [tok.eos_token_id] if eos else tok.encode("</think>", add_special_tokens=False)
            forced[rid] = ids
        return forced[rid]

    def finish(launched) -> RunnerOutput:
        out = real_finish(launched)
        toks = [list(t) for t in out.sampled_token_ids]  # per request: the tokens it gained (one here)
        for i, rid in enumerate(out.req_ids):
            script, k = script_for(rid), engine.scheduler.requests[rid].num_output_tokens
            if k < len(script):
                toks[i] = [script[k]]
        return RunnerOutput(out.req_ids, toks, out.logprobs)
    engine.executor.finish = finish


@pytest.fixture(scope="module")
def scripted():
    llm = LLM(**ENGINE_KW, reasoning_parser="qwen3")
    _force_prefixes(llm)
    yield from _serve(AsyncEngine(llm.llm_engine))


def test_auto_tool_call_parsed(scripted):
    c, m = scripted.client, scripted.model
    msgs = [{"role": "user", "content": "SCRIPT:call What is the weather in Paris?"}]
    r = c.chat.completions.create(model=m, messages=msgs, max_tokens=80, temperature=0, tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking.\n"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    chunks = list(c.chat.completions.create(model=m, messages=msgs, max_tokens=80, temperature=0, tools=TOOLS,
                                            stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert content == "Checking.\n" and [tc.function.name for tc in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = c.chat.completions.create(model=m, messages=msgs, max_tokens=80, temperature=0, tools=TOOLS,
                                      tool_choice="none")
    assert "<tool_call>" in plain.choices[0].message.content and not plain.choices[0].message.tool_calls


def test_reasoning_split_and_constraint_after_it(scripted):
    c, m = scripted.client, scripted.model
    msgs = [{"role": "user", "content": "SCRIPT:think " + PERSON["prompt"]}]
    fmt = _schema_format(PERSON["schema"])
    r = c.chat.completions.create(model=m, messages=msgs, max_tokens=120, temperature=0, response_format=fmt)
    msg = r.choices[0].message
    assert msg.reasoning_content == "\nPlanning a JSON answer.\n"  # forced, unconstrained
    jsonschema.validate(json.loads(msg.content), PERSON["schema"])  # sampled after </think>, constrained
    chunks = list(c.chat.completions.create(model=m, messages=msgs, max_tokens=120, temperature=0,
                                            response_format=fmt, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == msg.content
    r = c.chat.completions.create(model=m, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.reasoning_content is None
