"""POST /v1/chat/completions: messages, formatted with the model's chat template."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response, StreamingResponse

from minivllm.engine.tokenizer import apply_chat_template
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.reasoning import get_reasoning_parser
from minivllm.server import logprobs as lp_fmt
from minivllm.server.chat_output import ChatOutputOptions, ChoiceStream, finish_reason_of, message
from minivllm.server.errors import JSONResponse, OpenAIError, bad_request
from minivllm.server.params import chat_params
from minivllm.server.protocol import ChatCompletionRequest, ChatMessage
from minivllm.server.serving_common import (
    ServingBase,
    check_no_internal_error,
    collect_or_abort,
    kv_transfer_field,
    new_id,
    sse,
    sse_body,
    stream_usage,
    usage,
)
from minivllm.server.structured import resolve_constraint
from minivllm.server.tools import resolve_tool_mode, tool_constraint

logger = logging.getLogger(__name__)


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Plain dicts for the template; content parts are joined (text only); an assistant's
    tool_calls (arguments parsed from JSON text into objects, as templates expect) and a tool
    message's tool_call_id go through."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content: unsupported content part of type {part.type!r} "
                                      f"(only {{'type': 'text', 'text': ...}} parts are supported)", "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        d = {"role": m.role, "content": "" if content is None else content}  # templates expect a str
        if m.name is not None:
            d["name"] = m.name
        extra = m.model_extra or {}
        if extra.get("tool_calls"):
            d["tool_calls"] = _template_tool_calls(extra["tool_calls"], i)
        if extra.get("tool_call_id") is not None:
            d["tool_call_id"] = extra["tool_call_id"]
        out.append(d)
    return out


def _template_tool_calls(calls, i: int) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"messages[{i}].tool_calls entries need function.name", "messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise bad_request(f"messages[{i}].tool_calls: function.arguments is not JSON", "messages") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                    continue_final_message: bool, tools: list[dict] | None = None) -> list[int]:
    """Token ids of the formatted conversation; any template failure is the input's fault: 400."""
    if tokenizer is None:
        raise bad_request("chat needs a tokenizer (the server runs without one)", "messages")
    if continue_final_message and add_generation_prompt:
        add_generation_prompt = False  # continuing the last (assistant) message adds no new turn
    msgs = message_dicts(messages)
    kwargs = {"continue_final_message": True} if continue_final_message else {}
    if tools:
        kwargs["tools"] = tools
    try:
        return apply_chat_template(tokenizer, msgs, add_generation_prompt, **kwargs)
    except OpenAIError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja errors, role checks raised by the template, ...
        logger.info("chat template refused the conversation: %r", e)
        raise bad_request(f"the chat template could not format these messages: {type(e).__name__}: {e}",
                          "messages") from None


class ServingChat(ServingBase):
    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        opts = self._output_options(req)
        structured = await resolve_constraint(req, self.engine.config.structured_outputs.backend,
                                        tool_constraint(req, opts.tools))
        params = chat_params(req, self.engine.config.model.arch.vocab_size, structured)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        ids = chat_prompt_ids(self.engine.tokenizer, req.messages, req.add_generation_prompt,
                              req.continue_final_message, tools)
        rid = new_id("chatcmpl")
        streams = await self.submit(rid, [{"prompt_token_ids": ids}], params, req.priority, "messages",
                                    req.cache_salt, self.lora_for(req.model))
        created = int(time.time())
        if req.stream:
            return StreamingResponse(sse_body(self._stream(req, opts, streams[0], rid, model, created), streams),
                                     media_type="text/event-stream")
        finals = await collect_or_abort(raw, streams)
        if finals is None:
            return Response(status_code=499)
        check_no_internal_error(finals)
        return JSONResponse(self._response(req, opts, finals[0], rid, model, created))

    def _output_options(self, req: ChatCompletionRequest) -> ChatOutputOptions:
        s = self.settings
        name = self.engine.config.structured_outputs.reasoning_parser
        return ChatOutputOptions(get_reasoning_parser(name) if name else None,
                                 resolve_tool_mode(req, s.enable_auto_tool_choice, s.tool_call_parser))

    def _logprobs(self, req: ChatCompletionRequest, o: CompletionOutput, start: int) -> dict | None:
        if not req.logprobs:
            return None
        content = lp_fmt.chat_logprobs(o.token_ids[start:], (o.logprobs or [])[start:], req.top_logprobs or 0,
                                       self.engine.tokenizer)
        return {"content": [c.model_dump() for c in content]}

    def _response(self, req: ChatCompletionRequest, opts: ChatOutputOptions, out: RequestOutput, rid: str,
                  model: str, created: int) -> dict:
        choices = []
        for o in out.outputs:
            msg, finish = message(opts, o.text, o.finish_reason)
            choices.append({"index": o.index, "message": msg, "logprobs": self._logprobs(req, o, 0),
                            "finish_reason": finish, "stop_reason": o.stop_reason})
        n_gen = sum(len(o.token_ids) for o in out.outputs)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": usage(len(out.prompt_token_ids), n_gen), **kv_transfer_field([out])}

    async def _stream(self, req: ChatCompletionRequest, opts: ChatOutputOptions, stream, rid: str, model: str,
                      created: int) -> AsyncIterator[str]:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        sent_text = [0] * req.n
        sent_tokens = [0] * req.n
        done = [False] * req.n
        choice_streams = [ChoiceStream(opts) for _ in range(req.n)]
        last: RequestOutput | None = None
        for i in range(req.n):  # OpenAI opens each choice with the role
            yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        async for out in stream:
            last = out
            for o in out.outputs:
                k = o.index
                text, new = o.text[sent_text[k]:], len(o.token_ids) - sent_tokens[k]
                if done[k] or not (text or new > 0 or o.finish_reason):
                    continue
                cs = choice_streams[k]
                delta = cs.delta(text)
                finish = None
                if o.finish_reason is not None:
                    delta = _merge(delta, cs.finish())
                    finish = finish_reason_of(opts, o.finish_reason, cs.num_calls > 0)
                logprobs = self._logprobs(req, o, sent_tokens[k])
                sent_text[k], sent_tokens[k], done[k] = len(o.text), len(o.token_ids), o.finish_reason is not None
                if not delta and finish is None and logprobs is None:
                    continue  # held back (a possible marker): nothing to send yet
                choice = {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                if finish is not None:
                    choice["stop_reason"] = o.stop_reason
                n_gen = sum(len(x.token_ids) for x in out.outputs)
                yield sse({**head, "choices": [choice], **stream_usage(req, len(out.prompt_token_ids), n_gen)})
        if req.stream_options is not None and req.stream_options.include_usage and last is not None:
            n_gen = sum(len(o.token_ids) for o in last.outputs)
            yield sse({**head, "choices": [], "usage": usage(len(last.prompt_token_ids), n_gen)})


def _merge(a: dict, b: dict) -> dict:
    """Two chunk deltas as one (texts concatenated, tool-call lists joined)."""
    out = dict(a)
    for key, value in b.items():
        out[key] = out[key] + value if key in out else value
    return out
