"""Proposals from a model run autoregressively k steps: a separate small draft model with its own
KV cache, or the target's own first layers (layer-skip self-speculation).

KV slots. The draft's cache has the target's block layout (same block ids, the block manager's
tables), so a request's draft K/V of position i sits in the same slot as its target K/V, in the
draft's own tensors. Per step, for a request with L known tokens (the last one, just sampled, at
position L - 1, without target K/V yet):

    catch-up + first draft:  tokens [c, L) at positions c .. L - 1 -> d1  (c: where the draft's
                             K/V stops being right; the draft model's own count, or L - 1 for
                             layer skip, whose K/V are the target's first layers' own)
    draft j = 2 .. k:        d_{j-1} at position L + j - 2              -> d_j

The scheduler allocates k lookahead slots past every sampling step's tokens
(SpeculativeConfig.num_lookahead_tokens), so positions up to L + k - 2 have blocks. K/V written
for drafts that the target later rejects are overwritten: the next catch-up starts at L again.
Layer skip writes its first layers' K/V for d1 .. d_{k-1} into the target's cache; the target's
verify step writes the same slots (the same values where the draft was right) before any read.
"""

from __future__ import annotations

import torch

from minivllm.core.interfaces import ScheduledRequest
from minivllm.runner.input_batch import build_step_inputs
from minivllm.spec_decode.proposer import ProposalRequest


class ModelProposer:
    needs_hidden = False

    def __init__(self, model, block_size: int, device: torch.device, max_model_len: int,
                 num_layers: int | None = None) -> None:
        """model: a CausalLM (the draft model, with its own KV cache; or the target itself with
        num_layers set: its first num_layers layers draft, on the target's KV cache)."""
        self.model, self.num_layers = model, num_layers
        self.block_size, self.device, self.max_model_len = block_size, device, max_model_len
        self._computed: dict[str, int] = {}  # draft K/V are right for positions < this

    @property
    def shares_target_kv(self) -> bool:
        return self.num_layers is not None

    def drop(self, req_ids) -> None:
        for r in req_ids:
            self._computed.pop(r, None)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest], k: int, hidden=None) -> list[list[int]]:
        # the first pass writes the last known token's K/V: only where its slot was allocated
        fits = [r.num_tokens <= self._slots(r) for r in requests]
        if not all(fits):
            some = self.propose([r for r, f in zip(requests, fits) if f], k) if any(fits) else []
            it = iter(some)
            return [next(it) if f else [] for f in fits]
        if not requests:
            return []
        tables = {r.req_id: r.block_ids for r in requests}
        first = [self._catch_up(r) for r in requests]
        drafts = [self._run(first, tables, None)]  # [B] d1
        active = list(range(len(requests)))
        for j in range(1, k):
            # draft j + 1 from d_j at position L + j - 1; only where that position fits the context
            active = [i for i in active if requests[i].num_tokens + j - 1 < self._slots(requests[i])]
            if not active:
                break
            sched = [ScheduledRequest(requests[i].req_id, [0], requests[i].num_tokens + j - 1, [], True)
                     for i in active]
            prev = drafts[-1]
            if len(active) < prev.shape[0]:
                prev = prev[torch.tensor(active, dtype=torch.int64, device=prev.device)]
            drafts.append(self._run(sched, tables, prev))
            if len(active) < len(requests):
                drafts[-1] = self._scatter(drafts[-1], active, len(requests))
        for r in requests:
            self._computed[r.req_id] = r.num_tokens
        host = torch.stack(drafts, dim=1).tolist()  # one copy: [B, <= k]
        return [[t for t in row[:self._limit(r, k)] if t >= 0] for row, r in zip(host, requests)]

    def _slots(self, r: ProposalRequest) -> int:
        """Positions the request may write: its allocated slots (the scheduler's lookahead may have
        been cut: no room in the cache, or max_tokens near), never past max_model_len."""
        return min(self.max_model_len, len(r.block_ids) * self.block_size)

    def _limit(self, r: ProposalRequest, k: int) -> int:
        return min(k, self._slots(r) - r.num_tokens + 1)

    def _scatter(self, part: torch.Tensor, active: list[int], b: int) -> torch.Tensor:
        full = torch.full((b,), -1, dtype=part.dtype, device=part.device)
        full[torch.tensor(active, dtype=torch.int64, device=part.device)] = part
        return full

    def _catch_up(self, r: ProposalRequest) -> ScheduledRequest:
        """The tokens whose draft K/V are missing, through the last known one."""
        n = r.num_tokens
        start = n - 1 if self.shares_target_kv else min(self._computed.get(r.req_id, 0), n - 1)
        p = len(r.prompt_token_ids)
        if start >= p:
            tokens = r.output_token_ids[start - p:]
        else:
            tokens = r.prompt_token_ids[start:] + r.output_token_ids
        return ScheduledRequest(r.req_id, tokens, start, [], True)

    def _run(self, sched: list[ScheduledRequest], tables: dict[str, list[int]],
             input_ids: torch.Tensor | None) -> torch.Tensor:
        """One draft forward over `sched` (input ids from the device when given): [B] argmax tokens."""
        inputs = build_step_inputs(sched, tables, self.block_size, self.device, pin=self.device.type == "cuda")
        if input_ids is not None:
            inputs.input_ids.copy_(input_ids)
        every_row = inputs.logits_indices.shape[0] == inputs.input_ids.shape[0]
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta,
                            output_rows=None if every_row else inputs.logits_indices, num_layers=self.num_layers)
        return self.model.compute_greedy_tokens(hidden)
