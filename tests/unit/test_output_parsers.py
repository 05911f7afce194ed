"""Reasoning and tool-call parsers on scripted texts: the whole-text split, and the same text
streamed in random pieces, which must add up to the same reasoning, content and calls."""

from __future__ import annotations

import json
import random

import pytest

from minivllm.reasoning import get_reasoning_parser
from minivllm.server.chat_output import ChatOutputOptions, ChoiceStream, message
from minivllm.server.tool_parsers import get_tool_parser
from minivllm.server.tools import ToolMode

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
ARGS = json.dumps({"city": "Paris", "days": 3})


def _pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i:i + n])
        i += n
    return out


def _stream(opts: ChatOutputOptions, text: str, seed: int) -> tuple[str, str, list[dict], int]:
    cs = ChoiceStream(opts)
    deltas = [cs.delta(p) for p in _pieces(text, seed)] + [cs.finish()]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            entry["name"] += c.get("function", {}).get("name") or ""
            entry["arguments"] += c["function"].get("arguments") or ""
    return reasoning, content, [calls[i] for i in sorted(calls)], cs.num_calls


@pytest.mark.parametrize("name,text,want", [
    ("qwen3", "<think>Paris is in France.</think>\n\nThe answer is Paris.",
     ("Paris is in France.", "\n\nThe answer is Paris.")),
    ("qwen3", "No thinking here.", (None, "No thinking here.")),
    ("qwen3", "<think>cut off while thinking", ("cut off while thinking", None)),
    ("deepseek_r1", "still thinking</think>Answer.", ("still thinking", "Answer.")),
    ("deepseek_r1", "<think>a</think>b", ("a", "b")),
    ("deepseek_r1", "only thoughts", ("only thoughts", None)),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reasoning_split_whole_and_streamed(name, text, want, seed):
    parser = get_reasoning_parser(name)
    assert parser.split(text) == want
    reasoning, content, _, _ = _stream(ChatOutputOptions(parser, ToolMode("none")), text, seed)
    assert (reasoning or None, content or None) == want


def test_reasoning_marker_ids_and_prompt_end():
    p = get_reasoning_parser("qwen3")
    start, end = (5, 6), (7,)
    assert p.ended_in_prompt([1, 5, 6, 9, 7, 3], start, end)  # the template closed the section
    assert not p.ended_in_prompt([1, 2, 3], start, end)
    assert not p.ended_in_prompt([7, 1, 5, 6, 2], start, end)  # an old end, then a new start


@pytest.mark.parametrize("text,content,names", [
    (f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>", "Let me check.\n", ["get_weather"]),
    (f"<tool_call>{CALL}</tool_call>\n<tool_call>{CALL}</tool_call>", None, ["get_weather", "get_weather"]),
    (f"<tool_call>{CALL}", None, ["get_weather"]),  # left open at the end (max_tokens, stop)
    ("Just an answer, <tool_ca no call.", "Just an answer, <tool_ca no call.", []),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_hermes(text, content, names, seed):
    got_content, calls = get_tool_parser("hermes").extract(text)
    assert got_content == content and [c.name for c in calls] == names
    assert all(json.loads(c.arguments) == json.loads(ARGS) for c in calls)
    _, s_content, s_calls, _ = _stream(ChatOutputOptions(None, ToolMode("auto", parser="hermes")), text, seed)
    assert (s_content or None) == content and [c["name"] for c in s_calls] == names
    assert all(json.loads(c["arguments"]) == json.loads(ARGS) for c in s_calls)


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'


@pytest.mark.parametrize("text,content,names", [
    (LLAMA_CALL, None, ["get_weather"]),
    (f"<|python_tag|>{LLAMA_CALL}; {LLAMA_CALL}", None, ["get_weather", "get_weather"]),
    ("The weather is nice.", "The weather is nice.", []),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_llama3_json(text, content, names, seed):
    got_content, calls = get_tool_parser("llama3_json").extract(text)
    assert got_content == content and [c.name for c in calls] == names
    _, s_content, s_calls, _ = _stream(ChatOutputOptions(None, ToolMode("auto", parser="llama3_json")), text, seed)
    assert (s_content or None) == content and [c["name"] for c in s_calls] == names


def test_message_reasoning_then_tool_call_and_finish_reason():
    opts = ChatOutputOptions(get_reasoning_parser("qwen3"), ToolMode("auto", parser="hermes"))
    text = f"<think>The user wants weather.</think>\n<tool_call>{CALL}</tool_call>"
    msg, finish = message(opts, text, "stop")
    assert msg["reasoning_content"] == "The user wants weather." and msg["content"] is None
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather" and finish == "tool_calls"
    assert msg["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    reasoning, content, calls, n = _stream(opts, text, 3)
    assert reasoning == "The user wants weather." and not content.strip() and n == 1


def test_required_and_named_modes():
    arr = f'[{{"name": "a", "parameters": {ARGS}}}, {{"name": "b", "parameters": {{}}}}]'
    msg, finish = message(ChatOutputOptions(None, ToolMode("required")), arr, "stop")
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["a", "b"] and finish == "tool_calls"
    msg, _ = message(ChatOutputOptions(None, ToolMode("required", parallel=False)), arr, "stop")
    assert len(msg["tool_calls"]) == 1
    _, _, calls, _ = _stream(ChatOutputOptions(None, ToolMode("required")), arr, 4)
    assert [c["name"] for c in calls] == ["a", "b"] and json.loads(calls[0]["arguments"]) == json.loads(ARGS)
    msg, finish = message(ChatOutputOptions(None, ToolMode("named", name="f")), ARGS, "stop")
    assert msg["tool_calls"][0]["function"] == {"name": "f", "arguments": ARGS} and finish == "stop"
    _, content, calls, _ = _stream(ChatOutputOptions(None, ToolMode("named", name="f")), ARGS, 5)
    assert calls == [{"name": "f", "arguments": ARGS}] and content == ""
    msg, finish = message(ChatOutputOptions(None, ToolMode("required")), arr[:20], "length")
    assert msg["tool_calls"] == [] and msg["content"] == arr[:20] and finish == "length"


def test_serve_flags():
    """`minivllm serve --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
    --structured-outputs-config ...` reach the server settings and the engine config's kwargs."""
    from minivllm.cli import build_parser
    from minivllm.engine.args import engine_kwargs
    from minivllm.server.cli import server_settings
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                      "--reasoning-parser", "qwen3", "--structured-outputs-config",
                                      '{"backend": "xgrammar"}'])
    s = server_settings(args)
    assert s.enable_auto_tool_choice and s.tool_call_parser == "hermes"
    kw = engine_kwargs(args)
    assert kw["reasoning_parser"] == "qwen3" and kw["structured_outputs_config"] == {"backend": "xgrammar"}
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        server_settings(build_parser().parse_args(["serve", "--enable-auto-tool-choice"]))


def test_structured_config_is_validated():
    from minivllm.engine.config_builder import _structured_config
    assert _structured_config({"backend": "xgrammar"}, "deepseek_r1").reasoning_parser == "deepseek_r1"
    with pytest.raises(ValueError, match="structured_outputs_config.backend must be one of"):
        _structured_config({"backend": "outlines"}, None)
    with pytest.raises(ValueError, match="unknown fields"):
        _structured_config({"bakend": "xgrammar"}, None)
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        _structured_config(None, "gpt")


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}{{ '\\n' }}"
    "{% endif %}"
    "{% for m in messages %}{{ m.role }}: "
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}{{ '\\n' }}"
    "{% endfor %}")


def test_tool_messages_go_through_the_chat_template():
    """An assistant's tool_calls reach the template with their arguments as an object, a tool
    message with its tool_call_id, and the tools themselves."""
    import copy

    from minivllm.engine.config_builder import build_engine_config
    from minivllm.engine.tokenizer import load_tokenizer
    from minivllm.server.protocol import ChatMessage
    from minivllm.server.serving_chat import chat_prompt_ids
    tok = copy.deepcopy(load_tokenizer(build_engine_config(device="cpu").model))
    tok.chat_template = TOOL_TEMPLATE
    msgs = [ChatMessage(**m) for m in [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = tok.decode(chat_prompt_ids(tok, msgs, False, False, tools))
    assert text == "TOOLS get_weather\nuser: Weather?\nassistant: CALL get_weather Paris\ntool: 18 C [call_1]\n"
