"""POST /v1/completions: prompts (text, token ids, or lists of either) -> text completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from starlette.responses import Response, StreamingResponse

from minivllm.engine.token_bytes import CharOffsets
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.server import logprobs as lp_fmt
from minivllm.server.errors import JSONResponse, bad_request
from minivllm.server.params import completion_params
from minivllm.server.protocol import CompletionRequest
from minivllm.server.structured import resolve_constraint
from minivllm.server.serving_common import (
    ServingBase,
    check_no_internal_error,
    collect_or_abort,
    kv_transfer_field,
    merge,
    new_id,
    sse,
    sse_body,
    stream_usage,
    usage,
)


def engine_prompts(prompt) -> list:
    """The request's prompt field as a list of engine prompts (one request each)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], str):
        return list(prompt)
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": list(prompt)}]
    return [{"prompt_token_ids": list(p)} for p in prompt]


@dataclass
class _ChoiceState:
    text_len: int = 0  # characters of the choice's text already sent
    num_tokens: int = 0  # tokens already sent
    offsets: CharOffsets | None = None  # text_offset of the next generated token (legacy logprobs)
    started: bool = False
    finished: bool = False


class ServingCompletion(ServingBase):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        structured = await resolve_constraint(req, self.engine.config.structured_outputs.backend)
        params = completion_params(req, self.engine.config.model.arch.vocab_size, structured)
        prompts = engine_prompts(req.prompt)
        if req.kv_transfer_params is not None and len(prompts) != 1:
            raise bad_request(f"kv_transfer_params needs a single prompt, got {len(prompts)}", "kv_transfer_params")
        rid = new_id("cmpl")
        streams = await self.submit(rid, prompts, params, req.priority, "prompt", req.cache_salt,
                                    self.lora_for(req.model))
        created = int(time.time())
        if req.stream:
            body = sse_body(self._stream(req, streams, rid, model, created), streams)
            return StreamingResponse(body, media_type="text/event-stream")
        finals = await collect_or_abort(raw, streams)
        if finals is None:
            return Response(status_code=499)  # nobody is listening any more
        check_no_internal_error(finals)
        return JSONResponse(self._response(req, finals, rid, model, created))

    # ---- helpers -----------------------------------------------------------------------------
    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.engine.tokenizer
        return tok.decode(out.prompt_token_ids) if tok is not None else ""

    def _prompt_logprobs(self, out: RequestOutput) -> lp_fmt.CompletionLogprobs:
        """The echoed prompt's part of the legacy logprobs: the engine's prompt logprobs (the first
        token has none: None, as in OpenAI and vLLM)."""
        entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return lp_fmt.completion_logprobs(out.prompt_token_ids, entries, CharOffsets(), self.engine.tokenizer)

    def _choice(self, req: CompletionRequest, out: RequestOutput, o: CompletionOutput, index: int) -> dict:
        o = _visible(req, o)
        prefix = self._prompt_text(out) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            gen = lp_fmt.completion_logprobs(o.token_ids, o.logprobs or [], CharOffsets(len(prefix)),
                                             self.engine.tokenizer)
            if req.echo:
                gen = lp_fmt.concat(self._prompt_logprobs(out), gen)
            logprobs = gen.model_dump()
        return {"index": index, "text": prefix + o.text, "logprobs": logprobs, "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason}

    def _response(self, req: CompletionRequest, finals: list[RequestOutput], rid: str, model: str,
                  created: int) -> dict:
        choices = [self._choice(req, out, o, i * req.n + o.index) for i, out in enumerate(finals) for o in out.outputs]
        n_prompt = sum(len(out.prompt_token_ids) for out in finals)
        n_gen = sum(len(_visible(req, o).token_ids) for out in finals for o in out.outputs)
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": usage(n_prompt, n_gen), **kv_transfer_field(finals)}

    def _delta(self, req: CompletionRequest, out: RequestOutput, o: CompletionOutput, st: _ChoiceState,
               index: int) -> dict | None:
        """The next chunk's choice for one sample, or None if nothing new."""
        if st.finished:
            return None
        o = _visible(req, o)
        prefix = self._prompt_text(out) if req.echo and not st.started else ""
        new_ids = o.token_ids[st.num_tokens:]
        text = o.text[st.text_len:]
        if not (prefix or text or new_ids or o.finish_reason or not st.started):
            return None
        logprobs = None
        if req.logprobs is not None:
            if st.offsets is None:
                st.offsets = CharOffsets(len(prefix))
            gen = lp_fmt.completion_logprobs(new_ids, (o.logprobs or [])[st.num_tokens:], st.offsets,
                                             self.engine.tokenizer)
            if prefix:
                gen = lp_fmt.concat(self._prompt_logprobs(out), gen)
            logprobs = gen.model_dump()
        st.started, st.text_len, st.num_tokens = True, len(o.text), len(o.token_ids)
        st.finished = o.finish_reason is not None
        return {"index": index, "text": prefix + text, "logprobs": logprobs, "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason}

    async def _stream(self, req: CompletionRequest, streams, rid: str, model: str,
                      created: int) -> AsyncIterator[str]:
        states: dict[int, _ChoiceState] = {}
        prompt_lens: dict[int, int] = {}
        n_gen: dict[int, int] = {}
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        async for i, out in merge(streams):
            prompt_lens[i] = len(out.prompt_token_ids)
            for o in out.outputs:
                index = i * req.n + o.index
                n_gen[index] = len(_visible(req, o).token_ids)
                choice = self._delta(req, out, o, states.setdefault(index, _ChoiceState()), index)
                if choice is not None:
                    yield sse({**head, "choices": [choice],
                               **stream_usage(req, sum(prompt_lens.values()), sum(n_gen.values()))})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage(sum(prompt_lens.values()), sum(n_gen.values()))})


def _visible(req: CompletionRequest, o: CompletionOutput) -> CompletionOutput:
    """max_tokens 0 (with echo): the step ran for the prompt's logprobs; its token is not shown."""
    if req.max_tokens != 0:
        return o
    return CompletionOutput(o.index, "", [], None, [] if o.logprobs is not None else None, "length", None)
