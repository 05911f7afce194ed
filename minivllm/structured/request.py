"""GrammarHandle: one sequence's grammar state, what the scheduler sees as `Request.grammar`.

Life of a handle: created when its request is added, holding the future of its compiled grammar
(shared through the manager's cache); ready once that compile is done (the scheduler keeps the
request waiting until then); its matcher is made on first use and advances with every accepted
token; released when the request finishes, is aborted or fails. Preemption keeps the handle, so
the request resumes where its grammar was.

With a reasoning parser, tokens up to the end of the reasoning section (`</think>`) are not
fed to the matcher and get no mask: the constraint starts after it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from minivllm.structured.backend import GrammarMatcher


class GrammarHandle:
    __slots__ = ("request_id", "_future", "_new_matcher", "_matcher", "released", "_terminated", "num_accepted",
                 "_end_marker", "reasoning_ended", "_thought")

    def __init__(self, request_id: str, future: Future, new_matcher: Callable[[Any], GrammarMatcher],
                 end_marker: tuple[int, ...] = (), reasoning_ended: bool = True) -> None:
        self.request_id = request_id
        self._future = future  # -> the compiled grammar
        self._new_matcher = new_matcher  # compiled grammar -> a fresh matcher (the backend's)
        self._matcher: GrammarMatcher | None = None
        self.released = False
        self._terminated = False
        self.num_accepted = 0  # tokens the matcher took (after the reasoning section)
        self._end_marker = end_marker  # token ids that end the reasoning section
        self.reasoning_ended = reasoning_ended
        self._thought: list[int] = []  # tokens of the reasoning section seen so far (for rollback)

    # ---- what the scheduler asks ---------------------------------------------------------------
    def is_ready(self) -> bool:
        """The grammar compiled (a failed compile is never ready: the engine ends the request)."""
        return self._future.done() and self._future.exception() is None

    def accept_token(self, token_id: int) -> bool:
        """Feed one sampled token; False if the grammar refuses it (the request then fails)."""
        if self.released or self._terminated:
            return True
        if not self.reasoning_ended:
            self._thought.append(token_id)
            n = len(self._end_marker)
            if n and tuple(self._thought[-n:]) == self._end_marker:
                self.reasoning_ended = True
            return True
        if not self.matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        self._terminated = self.matcher.is_terminated()
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def release(self) -> None:
        """The request is done: drop the matcher (the compiled grammar stays cached)."""
        self.released = True
        self._matcher = None

    # ---- engine side ---------------------------------------------------------------------------
    @property
    def failure(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    @property
    def matcher(self) -> GrammarMatcher:
        if self._matcher is None:
            self._matcher = self._new_matcher(self._future.result())
        return self._matcher

    def needs_mask(self) -> bool:
        """Whether this sequence's next token is constrained."""
        return not self.released and self.reasoning_ended and not self._terminated and self.is_ready()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (rejected speculative tokens), back into the
        reasoning section if need be."""
        if num_tokens <= 0 or self.released:
            return
        k = min(num_tokens, self.num_accepted)
        if k:
            self.matcher.rollback(k)
            self.num_accepted -= k
            self._terminated = self.matcher.is_terminated()
        rest = num_tokens - k
        if rest and self._thought:
            del self._thought[max(0, len(self._thought) - rest):]
            self.reasoning_ended = False
