"""Suffix decoding: proposals from suffix trees over the request's own tokens and over the outputs
of earlier requests (agentic and code-editing traffic repeats itself across requests).

Each tree is a trie of every substring of at most `depth` tokens, with counts: appending a token
to a sequence extends each of the (at most depth) suffixes that end there by one node. To propose,
find the longest suffix of the context (up to depth - 1 tokens) whose node has children, then
walk down the most frequent child while the path's probability (the product of child count /
sibling total) stays at or above `min_token_prob`, for at most min(k, ceil(factor * match length))
tokens: a long match speculates far, a short or ambiguous one little or not at all (the number
of speculated tokens is dynamic, as in SuffixDecoding, Oliaro et al. 2024). The request's own
tree is tried first, then the global one; the longer proposal wins.

The global tree holds the outputs of the last `max_cached_requests` finished requests; the
oldest is taken out (its substrings' counts decremented) when a new one comes in.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from minivllm.spec_decode.proposer import ProposalRequest


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTree:
    """Counts of every substring of at most `depth` tokens of the sequences added to it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Add (sign 1) or take out (sign -1) every substring of `tokens` of up to depth tokens."""
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start:start + self.depth]:
                child = node.children.get(t)
                if child is None:
                    if sign < 0:
                        break
                    child = node.children[t] = _Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[t]
                    break
                node = child

    def find(self, context: list[int], max_len: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (at most max_len tokens) that has children."""
        for n in range(min(max_len, len(context)), 0, -1):
            node = self.root
            for t in context[len(context) - n:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, n
        return None, 0

    def speculate(self, node: _Node, max_tokens: int, min_prob: float) -> list[int]:
        out, prob = [], 1.0
        while len(out) < max_tokens and node.children:
            total = sum(c.count for c in node.children.values())
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / total
            if prob < min_prob:
                break
            out.append(token)
            node = child
        return out


class _Live:
    """A running request's own tree, extended as its tokens come in."""

    def __init__(self, depth: int) -> None:
        self.tree = SuffixTree(depth)
        self.active: list[_Node] = []  # nodes of the suffixes (< depth tokens) ending at the last token
        self.size = 0

    def extend(self, tokens: list[int]) -> None:
        depth, root = self.tree.depth, self.tree.root
        for t in tokens:
            nxt = []
            for node in [root] + self.active:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                nxt.append(child)
            self.active = nxt[:depth - 1]  # the deepest suffix has no room to grow
            self.size += 1


class SuffixProposer:
    needs_hidden = False

    def __init__(self, depth: int, max_cached_requests: int, spec_factor: float, min_token_prob: float) -> None:
        self.depth, self.factor, self.min_prob = depth, spec_factor, min_token_prob
        self.max_cached = max_cached_requests
        self.global_tree = SuffixTree(depth)
        self._cached: OrderedDict[str, list[int]] = OrderedDict()  # finished outputs in the global tree
        self._live: dict[str, _Live] = {}
        self._outputs: dict[str, list[int]] = {}  # live requests' output lists (the runner's)

    def drop(self, req_ids) -> None:
        """A request left the runner: its output (if any) joins the global tree."""
        for r in req_ids:
            self._live.pop(r, None)
            output = self._outputs.pop(r, None)
            if output and self.max_cached > 0:
                self._remember(r, list(output))

    def _remember(self, req_id: str, output: list[int]) -> None:
        if req_id in self._cached:
            self.global_tree.add(self._cached.pop(req_id), sign=-1)
        self._cached[req_id] = output
        self.global_tree.add(output)
        while len(self._cached) > self.max_cached:
            _, old = self._cached.popitem(last=False)
            self.global_tree.add(old, sign=-1)

    def propose(self, requests: list[ProposalRequest], k: int, hidden=None) -> list[list[int]]:
        return [self._propose_one(r, k) for r in requests]

    def _propose_one(self, req: ProposalRequest, k: int) -> list[int]:
        live = self._live.get(req.req_id)
        if live is None:
            live = self._live[req.req_id] = _Live(self.depth)
        self._outputs[req.req_id] = req.output_token_ids
        tokens = req.tokens() if live.size == 0 else req.output_token_ids[live.size - len(req.prompt_token_ids):]
        live.extend(tokens)
        out = req.output_token_ids  # the last depth tokens, without copying the whole context
        context = out[-self.depth:] if len(out) >= self.depth else (req.prompt_token_ids[-self.depth:] + out)[-self.depth:]
        best: list[int] = []
        for tree in (live.tree, self.global_tree):
            node, n = tree.find(context, self.depth - 1)
            if node is None:
                continue
            limit = min(k, math.ceil(self.factor * n))
            cand = tree.speculate(node, limit, self.min_prob)
            if len(cand) > len(best):
                best = cand
        return best
