"""Turns a user prompt into validated token ids and per-sample scheduler Requests."""

from __future__ import annotations

import time
from dataclasses import dataclass

from minivllm.core.request import PromptGroup, Request
from minivllm.sampling_params import SamplingParams

PromptInput = str | list[int] | dict


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None  # {"cache_salt": ...}: shares cached prefix blocks only with the same salt


def parse_prompt(prompt: PromptInput, tokenizer) -> ProcessedPrompt:
    """Accepts text, a list of token ids, {"prompt": text} or {"prompt_token_ids": [...]}; a dict may
    carry a "cache_salt" (a non-empty string, vLLM's field)."""
    if isinstance(prompt, dict):
        salt = prompt.get("cache_salt")
        if salt is not None and not (isinstance(salt, str) and salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        if "prompt_token_ids" in prompt:
            return ProcessedPrompt(prompt.get("prompt"), list(prompt["prompt_token_ids"]), salt)
        if "prompt" not in prompt:
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        parsed = parse_prompt(prompt["prompt"], tokenizer)
        parsed.cache_salt = salt
        return parsed
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer (the engine was started with skip_tokenizer_init)")
        return ProcessedPrompt(prompt, list(tokenizer(prompt).input_ids))
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return ProcessedPrompt(None, list(prompt))
    raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _check_token_ids(tokens: list[int], vocab_size: int) -> None:
    if not tokens:
        raise ValueError("prompt is empty: it must contain at least one token")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range: token ids must be in [0, {vocab_size})")


def validate_prompt(tokens: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                    max_tokens_in_cache: int) -> int:
    """Checks the prompt against the limits; returns the resolved max_tokens."""
    _check_token_ids(tokens, vocab_size)
    n = len(tokens)
    if n >= max_model_len:
        raise ValueError(f"prompt is {n} tokens long, but the maximum context length (max_model_len) is "
                         f"{max_model_len} tokens, which must also leave room for at least 1 output token")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - n
    if n + max_tokens > max_model_len:
        raise ValueError(f"this model's maximum context length (max_model_len) is {max_model_len} tokens, but "
                         f"{n + max_tokens} were requested ({n} in the prompt + max_tokens={max_tokens}); "
                         f"lower max_tokens to at most {max_model_len - n}")
    if n + max_tokens > max_tokens_in_cache:
        raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens can never fit "
                         f"in the KV cache, which holds {max_tokens_in_cache} tokens")
    return max_tokens


def make_sample_requests(request_id: str, tokens: list[int], params: SamplingParams, max_tokens: int,
                         eos_token_ids: frozenset[int], priority: int, arrival_time: float | None,
                         lora_request=None, cache_salt: str | None = None) -> list[Request]:
    """One scheduler Request per sample; seeded samples get seed + index (as vLLM does)."""
    arrival = arrival_time if arrival_time is not None else time.time()
    group = PromptGroup(params.n) if params.n > 1 else None
    reqs = []
    for i in range(params.n):
        p = params
        if params.n > 1:
            p = params.clone()
            if p.seed is not None:
                p.seed = params.seed + i
        reqs.append(Request(child_request_id(request_id, i, params.n), tokens, p, eos_token_ids, arrival,
                            max_tokens, priority=priority, sample_index=i, group=group, lora_request=lora_request,
                            cache_salt=cache_salt))
    return reqs


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def validate_pooling_prompt(tokens: list[int], vocab_size: int, max_model_len: int, max_tokens_in_cache: int) -> None:
    """An embedding request computes its prompt only: it may fill the whole context."""
    _check_token_ids(tokens, vocab_size)
    n = len(tokens)
    if n > min(max_model_len, max_tokens_in_cache):
        limit = "max_model_len" if max_model_len <= max_tokens_in_cache else "the KV cache's capacity"
        raise ValueError(f"input is {n} tokens long, but {limit} is {min(max_model_len, max_tokens_in_cache)} "
                         "tokens")


def make_pooling_request(request_id: str, tokens: list[int], pooling, eos_token_ids: frozenset[int],
                         priority: int, arrival_time: float | None, lora_request=None,
                         cache_salt: int | None = None) -> Request:
    """One scheduler Request that computes the prompt and returns its pooled hidden state."""
    arrival = arrival_time if arrival_time is not None else time.time()
    return Request(request_id, tokens, SamplingParams(max_tokens=1), eos_token_ids, arrival, 1, priority=priority,
                   pooling=pooling, lora_request=lora_request, cache_salt=cache_salt)


def beam_sampling_params(params) -> SamplingParams:
    """What a beam's step computes: the argmax and the 2 * beam_width most likely tokens' logprobs
    (set past SamplingParams' user limit on logprobs: the engine asks, not a user)."""
    sp = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
    sp.logprobs = 2 * params.beam_width
    return sp


def make_beam_request(request_id: str, tokens: list[int], params, max_tokens: int, eos_token_ids: frozenset[int],
                      priority: int, arrival_time: float | None, lora_request=None,
                      cache_salt: int | None = None) -> Request:
    """The first beam of a beam-search request (the scheduler forks the others from it)."""
    from minivllm.core.beam import BeamGroup
    arrival = arrival_time if arrival_time is not None else time.time()
    group = BeamGroup(request_id, params, len(tokens), eos_token_ids)
    return Request(group.new_beam_id(), tokens, beam_sampling_params(params), eos_token_ids, arrival, max_tokens,
                   priority=priority, lora_request=lora_request, cache_salt=cache_salt, beam=group)
