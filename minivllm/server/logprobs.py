"""Engine logprobs ({token_id: Logprob} per generated token) in OpenAI's two formats.

- completions (legacy): tokens, token_logprobs, top_logprobs ({token string: logprob}), and
  text_offset (character offset of each token in the choice's text, echoed prompt included);
- chat: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}].
JSON has no -inf, so logprobs are clamped to -9999.0 (as vLLM does).
"""

from __future__ import annotations

import math

from minivllm.outputs import Logprob
from minivllm.server.protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob

_FLOOR = -9999.0


def clamp(x: float) -> float:
    return _FLOOR if math.isnan(x) or x < _FLOOR else float(x)


def token_str(tid: int, lp: Logprob | None, tokenizer) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    if tokenizer is not None:
        return tokenizer.decode([tid])
    return f"token_id:{tid}"


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], text_offset: int,
                        tokenizer) -> CompletionLogprobs:
    """Legacy logprobs for generated tokens, offsets counted from text_offset."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids, logprobs):
        lp = entry.get(tid)
        s = token_str(tid, lp, tokenizer)
        out.tokens.append(s)
        out.token_logprobs.append(clamp(lp.logprob) if lp is not None else None)
        out.top_logprobs.append({token_str(t, p, tokenizer): clamp(p.logprob) for t, p in entry.items()})
        out.text_offset.append(text_offset)
        text_offset += len(s)
    return out


def prompt_logprobs_placeholder(prompt_ids: list[int], tokenizer) -> CompletionLogprobs:
    """Echoed prompt tokens: the engine computes no prompt logprobs, so their values are None
    (OpenAI and vLLM also give None for the first prompt token)."""
    out = CompletionLogprobs()
    offset = 0
    for tid in prompt_ids:
        s = token_str(tid, None, tokenizer)
        out.tokens.append(s)
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
        out.text_offset.append(offset)
        offset += len(s)
    return out


def concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset, token_logprobs=a.token_logprobs +
                              b.token_logprobs, tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)


def _top(tid: int, lp: Logprob, tokenizer) -> TopLogprob:
    s = token_str(tid, lp, tokenizer)
    return TopLogprob(token=s, logprob=clamp(lp.logprob), bytes=list(s.encode("utf-8", errors="replace")))


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int,
                  tokenizer) -> list[ChatTokenLogprob]:
    content = []
    for tid, entry in zip(token_ids, logprobs):
        lp = entry.get(tid) or Logprob(float("-inf"))
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        top = [_top(t, p, tokenizer) for t, p in ranked[:num_top]]
        main = _top(tid, lp, tokenizer)
        content.append(ChatTokenLogprob(token=main.token, logprob=main.logprob, bytes=main.bytes, top_logprobs=top))
    return content
