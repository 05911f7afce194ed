"""Request fields -> SamplingParams, with the checks that need the model (vocab size)."""

from __future__ import annotations

from minivllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from minivllm.server.errors import OpenAIError, bad_request, from_value_error
from minivllm.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not raw:
        return None
    out: dict[int, float] = {}
    for key, bias in raw.items():
        try:
            tid = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                              "logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise bad_request(f"logit_bias token id {tid} is out of range: token ids must be in [0, {vocab_size})",
                              "logit_bias")
        out[tid] = float(bias)
    return out


def _common(req: SamplingFields, vocab_size: int) -> dict:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    return dict(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k in (None, -1) else req.top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        extra_args=_kv_extra_args(req),
    )


def _kv_extra_args(req: SamplingFields) -> dict | None:
    """kv_transfer_params, checked here (400 naming the field), ride in SamplingParams.extra_args."""
    if req.kv_transfer_params is None:
        return None
    from minivllm.kv_transfer.params import KV_TRANSFER_PARAMS, parse
    try:
        parse(req.kv_transfer_params)
    except ValueError as e:
        raise from_value_error(e, "kv_transfer_params") from None
    if req.n != 1 or req.use_beam_search:
        raise bad_request("kv_transfer_params needs n == 1 and no beam search", "kv_transfer_params")
    return {KV_TRANSFER_PARAMS: req.kv_transfer_params}


def _build(kwargs: dict) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_value_error(e) from None


def completion_params(req: CompletionRequest, vocab_size: int,
                      structured: StructuredOutputsParams | None = None) -> SamplingParams | BeamSearchParams:
    """max_tokens 0 (with echo) runs one step for the prompt's logprobs; the server shows no
    completion (serving_completions.py)."""
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of must equal n ({req.n}) when given: ranking samples is not supported, "
                          f"got best_of={req.best_of}", "best_of")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be >= 1 (0 is allowed only with echo: the prompt alone)", "max_tokens")
    if req.use_beam_search:
        if req.echo or req.logprobs is not None:
            raise bad_request("echo and logprobs are not supported with use_beam_search",
                              "echo" if req.echo else "logprobs")
        return beam_params(req, req.max_tokens, structured)
    kwargs = _common(req, vocab_size)
    prompt_logprobs = req.logprobs if req.echo else None  # the echoed prompt's part of logprobs
    return _build({**kwargs, "max_tokens": req.max_tokens or 1, "logprobs": req.logprobs,
                   "prompt_logprobs": prompt_logprobs, "structured_outputs": structured})


# sampling fields beam search does not use: set to anything but their default, a 400 (never ignored)
_NOT_WITH_BEAMS = ("top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "logit_bias", "stop", "stop_token_ids", "min_tokens", "include_stop_str_in_output")


def beam_params(req: SamplingFields, max_tokens: int | None, structured) -> BeamSearchParams:
    """use_beam_search: n beams (vLLM's BeamSearchParams); max_tokens None: 16 as vLLM's default."""
    fields_set = req.model_fields_set
    for name in _NOT_WITH_BEAMS:
        if name in fields_set and getattr(req, name) not in (None, [], {}, False, 0, -1, 1.0, ""):
            raise bad_request(f"{name} is not supported with use_beam_search", name)
    if structured is not None:
        raise bad_request("structured outputs are not supported with use_beam_search", "use_beam_search")
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=16 if max_tokens is None else max_tokens,
                                ignore_eos=req.ignore_eos, temperature=req.temperature or 0.0,
                                length_penalty=req.length_penalty)
    except ValueError as e:
        raise from_value_error(e, "n") from None


def chat_params(req: ChatCompletionRequest, vocab_size: int,
                structured: StructuredOutputsParams | None = None) -> SamplingParams | BeamSearchParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.use_beam_search:
        if req.logprobs or req.tools:
            raise bad_request("logprobs and tools are not supported with use_beam_search",
                              "logprobs" if req.logprobs else "tools")
        return beam_params(req, max_tokens, structured)
    kwargs = _common(req, vocab_size)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _build({**kwargs, "max_tokens": max_tokens, "logprobs": logprobs, "structured_outputs": structured})


__all__ = ["OpenAIError", "chat_params", "completion_params"]
