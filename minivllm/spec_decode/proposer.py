"""What every proposer sees and returns: the requests about to decode, and up to k tokens each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class ProposalRequest:
    """One request that sampled this step and will decode next. The token lists are the runner's
    own (not copies): read them, never change them."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # every output token, this step's included
    block_ids: list[int]  # the request's block table: its tokens' slots and the lookahead ones

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class Proposer(Protocol):
    # the proposer wants the target's final hidden state of each request's last token (Medusa)
    needs_hidden: bool

    def propose(self, requests: list[ProposalRequest], k: int, hidden: torch.Tensor | None) -> list[list[int]]:
        """Up to k tokens to follow each request's tokens (fewer or none where it has no guess).
        hidden: [B, H] when needs_hidden, else None."""

    def drop(self, req_ids) -> None:
        """Forget per-request state (finished or preempted requests)."""
