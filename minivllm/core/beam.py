"""Beam search state of one request: its live beams, their scores and the completed hypotheses.

Every beam is a scheduler Request, scheduled like any sequence (continuous batching, chunked
recompute after preemption). A step of a beam computes its last token and returns the top
2 * beam_width candidates of the next one (their log-probabilities, TokenLogprobs) instead of
appending a token. Once every live beam of the group has reported, `select` runs vLLM's rule:

    candidates = every (beam, token) of the reported lists, cum = beam's cum + logprob
    a candidate ending on eos (unless ignore_eos) is a completed hypothesis
    the others, ranked by score (stable), the first beam_width are the next beams
    at max_tokens: completed + beams ranked by score, the first beam_width are the result
    score = cum_logprob / len(prompt + output) ** length_penalty   (a final eos not counted)

The scheduler turns the selection into sequences: a parent's first selected token is appended
to the parent itself, each further one to a fork of it (its block table copied, block manager),
and parents selected by nobody are released.

Token histories form a tree (`BeamNode`): forks share their common prefix's nodes, so a step
costs O(beam_width) whatever the length.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from minivllm.core.interfaces import TokenLogprobs
from minivllm.core.request import Request
from minivllm.sampling_params import BeamSearchParams


@dataclass(slots=True, eq=False)
class BeamNode:
    """One generated token of a beam and the candidates of its step ({token: logprob})."""

    parent: BeamNode | None
    token_id: int
    logprobs: dict[int, float]


@dataclass(slots=True)
class BeamHypothesis:
    token_ids: list[int]  # generated tokens (the final eos included when it ended on one)
    cum_logprob: float
    logprobs: list[dict[int, float]]  # per generated token: that step's candidates
    finish_reason: str  # "stop" (eos) or "length"
    score: float


@dataclass(slots=True)
class _Candidate:
    parent: Request
    token_id: int
    cum_logprob: float
    node: BeamNode


def beam_score(num_tokens: int, cum_logprob: float, ends_with_eos: bool, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: num_tokens counts prompt and output, an eos at the end not."""
    length = num_tokens - 1 if ends_with_eos else num_tokens
    return cum_logprob / (length ** length_penalty)


class BeamGroup:
    """The beams of one beam-search request (see the module docstring)."""

    def __init__(self, request_id: str, params: BeamSearchParams, num_prompt_tokens: int,
                 eos_token_ids: frozenset[int]) -> None:
        self.request_id = request_id
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.eos_token_ids = eos_token_ids
        self.live: list[Request] = []  # in rank order (best first)
        self.cum: dict[str, float] = {}  # beam id -> cumulative logprob
        self.node: dict[str, BeamNode | None] = {}  # beam id -> its last token's node
        self.reported: dict[str, list[tuple[int, float]]] = {}  # beam id -> this step's candidates
        self.completed: list[BeamHypothesis] = []
        self.result: list[BeamHypothesis] | None = None  # set when the search ends
        self._ids = itertools.count()

    # ---- beams ----------------------------------------------------------------------------
    def new_beam_id(self) -> str:
        return f"{self.request_id}#beam{next(self._ids)}"

    def add_root(self, req: Request) -> None:
        self.live = [req]
        self.cum[req.request_id] = 0.0
        self.node[req.request_id] = None

    def has_reported(self, req: Request) -> bool:
        return req.request_id in self.reported

    @property
    def all_reported(self) -> bool:
        return all(r.request_id in self.reported for r in self.live)

    def report(self, req: Request, lp: TokenLogprobs) -> None:
        """A beam's step: its candidates for the next token (the sampled one first, then the top-k;
        duplicates collapse, as in a dict)."""
        seen: dict[int, float] = {}
        for tid, val in zip(lp.token_ids, lp.logprobs):
            seen.setdefault(tid, val)
        self.reported[req.request_id] = list(seen.items())

    # ---- one step of the search -------------------------------------------------------------
    def select(self) -> list[_Candidate]:
        """vLLM's rule over the reported candidates: eos candidates complete, the best
        beam_width others are returned (best first). Clears the reports."""
        p = self.params
        new: list[_Candidate] = []
        for beam in self.live:
            cands = self.reported.pop(beam.request_id)
            lps = dict(cands)
            for tid, val in cands:
                cum = self.cum[beam.request_id] + val
                node = BeamNode(self.node[beam.request_id], tid, lps)
                if tid in self.eos_token_ids and not p.ignore_eos:
                    self.completed.append(self._hypothesis(node, cum, beam.num_tokens + 1, "stop"))
                else:
                    new.append(_Candidate(beam, tid, cum, node))
        # every new beam has the same length: the score orders them as cum_logprob does
        new.sort(key=lambda c: c.cum_logprob, reverse=True)
        return new[:p.beam_width]

    def set_live(self, beams: list[tuple[Request, _Candidate]]) -> None:
        """The next live beams (request, the candidate it took), best first."""
        self.live = [r for r, _ in beams]
        self.cum = {r.request_id: c.cum_logprob for r, c in beams}
        self.node = {r.request_id: c.node for r, c in beams}

    def finish(self, last: list[_Candidate]) -> None:
        """max_tokens reached (or no beam left): rank completed + the last beams, keep beam_width."""
        for c in last:
            n = c.parent.num_tokens + 1
            self.completed.append(self._hypothesis(c.node, c.cum_logprob, n, "length"))
        self.completed.sort(key=lambda h: h.score, reverse=True)
        self.result = self.completed[:self.params.beam_width]
        self.live = []

    def _hypothesis(self, node: BeamNode, cum: float, num_tokens: int, reason: str) -> BeamHypothesis:
        tokens, lps = [], []
        while node is not None:
            tokens.append(node.token_id)
            lps.append(node.logprobs)
            node = node.parent
        tokens.reverse()
        lps.reverse()
        ends_eos = tokens[-1] in self.eos_token_ids
        return BeamHypothesis(tokens, cum, lps, reason,
                              beam_score(num_tokens, cum, ends_eos, self.params.length_penalty))
