"""N-gram (prompt lookup) proposals: find the latest earlier occurrence of the context's last n
tokens (n from prompt_lookup_max down to prompt_lookup_min) and propose the k tokens that
followed it. Repetitive, input-grounded text (summaries that quote, code edits) is full of them.

Vectorised over the batch: the contexts are right-aligned in one [B, L] array (shorter ones padded
on the left with -1, which matches no token), and for each offset j the test "token at t - j equals
the context's j-th token from the end" is one [B, L] comparison. run[j] holds the positions where
the last j + 1 tokens all match; a match of length n at position t proposes the tokens from t + 1.
Cost: prompt_lookup_max array passes, no per-token Python loop.
"""

from __future__ import annotations

import numpy as np

from minivllm.spec_decode.proposer import ProposalRequest

_PAD = -1


class NgramProposer:
    needs_hidden = False

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._buffers: dict[str, _TokenBuffer] = {}

    def drop(self, req_ids) -> None:
        for r in req_ids:
            self._buffers.pop(r, None)

    def propose(self, requests: list[ProposalRequest], k: int, hidden=None) -> list[list[int]]:
        if not requests:
            return []
        contexts = [self._buffer(r).view() for r in requests]
        return propose_ngrams(contexts, self.min_n, self.max_n, k)

    def _buffer(self, req: ProposalRequest) -> _TokenBuffer:
        buf = self._buffers.get(req.req_id)
        if buf is None:
            buf = self._buffers[req.req_id] = _TokenBuffer(req.prompt_token_ids)
        buf.extend(req.output_token_ids[buf.size - len(req.prompt_token_ids):])
        return buf


class _TokenBuffer:
    """A request's tokens as a growing int64 array (appends amortised O(1))."""

    def __init__(self, tokens: list[int]) -> None:
        self.data = np.asarray(tokens, dtype=np.int64)
        self.size = len(tokens)

    def extend(self, tokens: list[int]) -> None:
        if not tokens:
            return
        if self.size + len(tokens) > self.data.shape[0]:
            grown = np.empty(max(2 * self.data.shape[0], self.size + len(tokens)), dtype=np.int64)
            grown[:self.size] = self.data[:self.size]
            self.data = grown
        self.data[self.size:self.size + len(tokens)] = tokens
        self.size += len(tokens)

    def view(self) -> np.ndarray:
        return self.data[:self.size]


def propose_ngrams(contexts: list[np.ndarray], min_n: int, max_n: int, k: int) -> list[list[int]]:
    """For each context (int64 array), the k tokens after the latest earlier occurrence of its
    longest matching suffix of min_n..max_n tokens ([] where none)."""
    b = len(contexts)
    width = max(c.shape[0] for c in contexts)
    ctx = np.full((b, width), _PAD, dtype=np.int64)
    for i, c in enumerate(contexts):
        ctx[i, width - c.shape[0]:] = c
    lens = np.asarray([c.shape[0] for c in contexts])
    # run[t]: the tokens ending at t match the context's last (j + 1) tokens, for growing j;
    # t < width - 1 so the suffix does not match itself
    body = ctx[:, :-1]  # [B, L - 1]
    run = body == ctx[:, -1:]
    best_end = np.full(b, -1, dtype=np.int64)  # position of the match's last token, -1: none
    for j in range(1, max_n + 1):
        n = j  # run holds matches of length j here
        if n >= min_n:
            found = run.any(axis=1) & (lens > n)
            # the latest occurrence: the largest t where the run holds
            latest = width - 2 - np.argmax(run[:, ::-1], axis=1)
            best_end = np.where(found, latest, best_end)  # longer n seen later overrides
        if j == max_n:
            break
        shifted = np.full_like(body, _PAD - 1)  # matches nothing: position t - j does not exist
        shifted[:, j:] = body[:, :-j]
        run = run & (shifted == ctx[:, -1 - j:-j])
    out = []
    for i in range(b):
        t = best_end[i]
        out.append([] if t < 0 else ctx[i, t + 1:t + 1 + k].tolist())
    return out
