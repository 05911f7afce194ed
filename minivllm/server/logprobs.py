"""Engine logprobs ({token_id: Logprob} per token) in OpenAI's two formats.

- completions (legacy): tokens, token_logprobs, top_logprobs ({token string: logprob}), and
  text_offset (character offset of each token in the choice's text, echoed prompt included);
- chat: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}].
`bytes` and `text_offset` come from each token's real bytes (engine/token_bytes.py): a token
holding part of a multi-byte character decodes to '\ufffd' on its own, but its bytes joined with
its neighbours' rebuild the text, and offsets count a split character once.
JSON has no -inf, so logprobs are clamped to -9999.0 (as vLLM does).
"""

from __future__ import annotations

import math

from minivllm.engine.token_bytes import CharOffsets, token_bytes
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


def _bytes_of(tid: int, s: str, tokenizer) -> bytes:
    return token_bytes(tokenizer)(tid) if tokenizer is not None else s.encode("utf-8")


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None],
                        offsets: CharOffsets, tokenizer) -> CompletionLogprobs:
    """Legacy logprobs of consecutive tokens; `offsets` continues where the text before them ended
    (the echoed prompt, the chunks already streamed) and is advanced past them. An entry of None
    (the first prompt token, which has no logprob) gives None values."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids, logprobs):
        lp = entry.get(tid) if entry is not None else None
        s = token_str(tid, lp, tokenizer)
        out.tokens.append(s)
        out.token_logprobs.append(clamp(lp.logprob) if lp is not None else None)
        out.top_logprobs.append(None if entry is None else
                                {token_str(t, p, tokenizer): clamp(p.logprob) for t, p in entry.items()})
        # a special token (eos) adds no text: skip_special_tokens leaves it out of the output
        special = tokenizer is not None and token_bytes(tokenizer).is_special(tid)
        out.text_offset.append(offsets.advance(b"" if special else _bytes_of(tid, s, tokenizer)))
    return out


def concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset, token_logprobs=a.token_logprobs +
                              b.token_logprobs, tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)


def _top(tid: int, lp: Logprob, tokenizer) -> TopLogprob:
    s = token_str(tid, lp, tokenizer)
    return TopLogprob(token=s, logprob=clamp(lp.logprob), bytes=list(_bytes_of(tid, s, tokenizer)))


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
