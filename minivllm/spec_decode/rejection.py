"""Verification of proposed tokens: the output distribution stays exactly the target model's.

Layout of one verify step (two requests: A with drafts a1 a2, B with none):

    rows (logits of the target at each scheduled token):  A0 A1 A2 | B0
    draft to check against each row:                      a1 a2 -  | -
    A0's distribution is the target's for the token after A's last known one, so a1 is checked
    against A0, a2 against A1; A2 (and B0) give the extra token when everything is accepted.

Greedy rows: accept while the draft equals the row's argmax; the first mismatching row gives its
argmax instead, and if every draft is accepted the last row gives one more (the bonus). The output
is exactly non-speculative greedy decoding.

Random rows (the standard rule, Leviathan et al. 2023 / Chen et al. 2023): with p the target's
processed distribution (penalties, temperature, top-k/top-p/min-p) and q the draft's, accept draft
d with probability min(1, p(d) / q(d)); on the first rejection sample from norm(max(0, p - q));
after all accepted, sample the bonus from p. Each emitted token is then distributed by p. A
proposer without a distribution (n-gram, suffix, argmax drafts) has q = one-hot(d): accept with
probability p(d), resample from p with d removed.

Randomness: seeded rows draw the acceptance uniform from a counter-based hash of (seed, counter)
(sample/rng.py, its own stream) and the resampled token from the sampler's seeded exponential race
at the same counter (tokens generated before it), so a seeded request is reproducible whatever
batch it runs in; other rows use the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.sample.batch import SamplingBatch
from minivllm.sample.ops import apply_top_k_top_p_min_p
from minivllm.sample.rng import exponential_race, seeded_uniforms


@dataclass
class VerifyLayout:
    """Which rows belong to which request: request i owns rows starts[i] .. starts[i] + num_drafts[i]."""

    starts: torch.Tensor  # [B] int64
    num_drafts: torch.Tensor  # [B] int64
    draft_ids: torch.Tensor  # [B, K] int64 proposed tokens, padded with 0 past num_drafts
    max_drafts: int  # K

    @classmethod
    def build(cls, drafts: list[list[int]], device: torch.device) -> VerifyLayout:
        k = max((len(d) for d in drafts), default=0)
        counts = [len(d) for d in drafts]
        starts, s = [], 0
        for c in counts:
            starts.append(s)
            s += c + 1
        padded = [d + [0] * (k - len(d)) for d in drafts]
        host = torch.tensor([starts, counts], dtype=torch.int64)
        ids = torch.tensor(padded, dtype=torch.int64).view(len(drafts), k)
        return cls(host[0].to(device), host[1].to(device), ids.to(device), k)

    @property
    def num_rows(self) -> int:
        return int(self.num_drafts.sum().item()) + self.num_drafts.shape[0]


@dataclass
class VerifyOutput:
    tokens: torch.Tensor  # [B, K + 1] int64: accepted drafts, then the sampled token, then -1
    num_tokens: torch.Tensor  # [B] int64 in 1 .. num_drafts + 1
    row_tokens: torch.Tensor  # [R] int64: the token each row emitted (-1 for rows past it)


def _row_grid(layout: VerifyLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, K + 1] row index of each (request, position) and whether that position exists."""
    pos = torch.arange(layout.max_drafts + 1, device=layout.starts.device)
    valid = pos[None, :] <= layout.num_drafts[:, None]
    rows = (layout.starts[:, None] + pos[None, :]).masked_fill(~valid, 0)
    return rows, valid


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The random rows' sampling distribution p: logits / T, top-k/top-p/min-p, softmax. [R, V] float32."""
    x = logits.div(batch.temperature.unsqueeze(1))
    x = apply_top_k_top_p_min_p(x, batch.top_k, batch.top_p, batch.min_p, batch.max_top_k)
    return x.softmax(dim=-1)


def verify(layout: VerifyLayout, batch: SamplingBatch, target_argmax: torch.Tensor | None,
           probs: torch.Tensor | None, draft_probs: torch.Tensor | None = None) -> VerifyOutput:
    """target_argmax: [R] argmax of the processed logits (needed when some row is greedy);
    probs: [R, V] target_probs (when some row is random); draft_probs: [R, V] q at the draft rows
    (None: every draft is a point mass). Rows follow `layout`; batch has one row per R."""
    rows, valid = _row_grid(layout)  # [B, K + 1]
    k = layout.max_drafts
    draft_valid = valid[:, :k] & (torch.arange(k, device=rows.device)[None, :] < layout.num_drafts[:, None])
    accept = _accept(layout, batch, rows[:, :k], target_argmax, probs, draft_probs) & draft_valid  # [B, K]
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B] leading accepts
    final_rows = layout.starts + num_accepted  # [B] the row that emits the last token
    rejected = num_accepted < layout.num_drafts
    final = _final_tokens(layout, batch, final_rows, rejected, target_argmax, probs, draft_probs)
    pos = torch.arange(k + 1, device=rows.device)[None, :]
    drafts = torch.nn.functional.pad(layout.draft_ids, (0, 1))  # [B, K + 1]
    tokens = torch.where(pos < num_accepted[:, None], drafts, -1)
    tokens = torch.where(pos == num_accepted[:, None], final[:, None], tokens)
    row_tokens = torch.full((batch.num_rows,), -1, dtype=torch.int64, device=rows.device)
    emitted = valid & (pos <= num_accepted[:, None])
    row_tokens[rows[emitted]] = tokens[emitted]
    return VerifyOutput(tokens, num_accepted + 1, row_tokens)


def _accept(layout: VerifyLayout, batch: SamplingBatch, draft_rows: torch.Tensor, target_argmax, probs,
            draft_probs) -> torch.Tensor:
    """[B, K] whether each draft passes on its own (the caller keeps only the leading run)."""
    drafts = layout.draft_ids
    greedy_ok = None
    if target_argmax is not None:
        greedy_ok = target_argmax[draft_rows] == drafts
        if batch.all_greedy:
            return greedy_ok
    p = probs[draft_rows, :].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, K] p(d)
    q = 1.0 if draft_probs is None else draft_probs[draft_rows, :].gather(2, drafts.unsqueeze(2)).squeeze(2)
    u = _uniforms(batch, draft_rows)
    random_ok = u * q <= p  # u in (0, 1): p(d) / q(d) >= 1 always accepts
    if greedy_ok is None:
        return random_ok
    return torch.where(batch.greedy_mask[draft_rows], greedy_ok, random_ok)


def _uniforms(batch: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
    """Acceptance uniforms in (0, 1) at the given rows [B, K]: seeded rows from the hash stream,
    others from the generator."""
    flat = rows.reshape(-1)
    u = torch.rand(flat.shape, generator=batch.generator, dtype=torch.float64, device=flat.device)
    u = u.clamp_(min=2.0 ** -53)  # (0, 1): never accept a p(d) = 0 draft
    s = batch.seeds
    if s is not None:
        seeds = torch.zeros(batch.num_rows, dtype=torch.int64, device=flat.device)
        counters = torch.zeros_like(seeds)
        seeded = torch.zeros(batch.num_rows, dtype=torch.bool, device=flat.device)
        idx = s.rows if s.rows is not None else torch.arange(batch.num_rows, device=flat.device)
        seeds[idx], counters[idx], seeded[idx] = s.seeds, s.counters, True
        u = torch.where(seeded[flat], seeded_uniforms(seeds[flat], counters[flat]), u)
    return u.view(rows.shape)


def _final_tokens(layout: VerifyLayout, batch: SamplingBatch, final_rows: torch.Tensor, rejected: torch.Tensor,
                  target_argmax, probs, draft_probs) -> torch.Tensor:
    """[B]: the correction token at the first rejected row, or the bonus token after the last draft."""
    greedy = target_argmax[final_rows] if target_argmax is not None else None
    if batch.all_greedy:
        return greedy
    p = probs[final_rows].clone()  # [B, V]
    if layout.max_drafts:
        position = (final_rows - layout.starts).clamp(max=layout.max_drafts - 1)  # (unused where not rejected)
        rejected_draft = layout.draft_ids.gather(1, position.unsqueeze(1)).squeeze(1)
        if draft_probs is None:  # q = one-hot(d): max(0, p - q) is p without d
            residual = p.scatter(1, rejected_draft.unsqueeze(1), 0.0)
        else:
            residual = (p - draft_probs[final_rows]).clamp_(min=0.0)
        mass = residual.sum(dim=1, keepdim=True)
        use = rejected.unsqueeze(1) & (mass > 0)  # (mass 0 only if p == q: then nothing is rejected)
        p = torch.where(use, residual / mass.clamp(min=1e-30), p)
    seeded_rows, seeds, counters = _gather_seeds(batch, final_rows)
    random = exponential_race(p, batch.generator, seeded_rows, seeds, counters)
    if greedy is None:
        return random
    return torch.where(batch.greedy_mask[final_rows], greedy, random)


def _gather_seeds(batch: SamplingBatch, rows: torch.Tensor):
    """The seeded ones among `rows` (positions into rows), with their seeds and counters."""
    s = batch.seeds
    if s is None:
        return None, None, None
    if s.rows is None:
        return None, s.seeds[rows], s.counters[rows]
    lookup = torch.full((batch.num_rows,), -1, dtype=torch.int64, device=rows.device)
    lookup[s.rows] = torch.arange(s.rows.shape[0], device=rows.device)
    at = lookup[rows]  # [B] index into the seed tensors, -1: not seeded
    keep = (at >= 0).nonzero().squeeze(1)
    if keep.numel() == 0:
        return None, None, None
    if keep.numel() == rows.shape[0]:
        return None, s.seeds[at], s.counters[at]
    return keep, s.seeds[at[keep]], s.counters[at[keep]]
