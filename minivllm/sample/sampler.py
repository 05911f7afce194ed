"""The batched sampler: logits [B, V] + SamplingBatch -> one token per row (+ logprobs).

Order of processing, per step, on the logits' device:

    raw logits ──► logprobs (log_softmax of the RAW logits, if any row asks)
        │
        ├─► logit_bias, allowed_token_ids, min_tokens (-inf on stop/eos)
        ├─► penalties (repetition, frequency, presence)
        ├─► greedy rows: argmax (kernels/greedy_argmax.py on CUDA)
        └─► random rows: / temperature ─► top-k ─► top-p ─► min-p ─► softmax
                         ─► exponential race (seeded hash or the engine's generator)

The caller's logits tensor is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.sample.batch import PenaltyTensors, SamplingBatch
from minivllm.sample.ops import apply_penalties, apply_top_k_top_p_min_p
from minivllm.sample.rng import exponential_race

__all__ = ["HostSamplerOutput", "Sampler", "SamplerOutput", "apply_top_k_top_p_min_p",
           "process_logits"]


@dataclass(slots=True)
class HostSamplerOutput:
    """SamplerOutput as Python lists (what the runner puts in its RunnerOutput)."""

    sampled_token_ids: list[int]
    logprob_token_ids: list[list[int]] | None = None  # [B][K+1], column 0 = sampled token
    logprobs: list[list[float]] | None = None
    sampled_ranks: list[int] | None = None


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Only when some row asks for logprobs; K = batch.max_num_logprobs. Column 0 is the
    # sampled token, columns 1..K the top-K tokens by raw logprob (rows wanting fewer slice).
    logprob_token_ids: torch.Tensor | None = None  # [B, K+1] int64
    logprobs: torch.Tensor | None = None  # [B, K+1] float32
    sampled_ranks: torch.Tensor | None = None  # [B] int64, 1-based (#tokens with logprob >=)

    def to_host(self) -> HostSamplerOutput:
        """Everything in one device-to-host copy (float32 logprobs travel as their bits)."""
        ids = self.sampled_token_ids
        if self.logprobs is None:
            return HostSamplerOutput(ids.tolist())
        b, width = self.logprobs.shape
        lp_bits = self.logprobs.contiguous().view(torch.int32).to(torch.int64)
        packed = torch.cat([ids, self.sampled_ranks, self.logprob_token_ids.reshape(-1),
                            lp_bits.reshape(-1)]).cpu()
        n = b * width
        tok = packed[2 * b: 2 * b + n].view(b, width).tolist()
        lps = packed[2 * b + n:].to(torch.int32).view(torch.float32).view(b, width).tolist()
        return HostSamplerOutput(packed[:b].tolist(), tok, lps, packed[b: 2 * b].tolist())


class Sampler:
    """Stateless; all per-step state is in the SamplingBatch."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # logits: [B, V], any float dtype; computation is in float32
        assert logits.dim() == 2, logits.shape
        assert logits.shape == (batch.num_rows, batch.vocab_size), (logits.shape, batch.num_rows)
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [B, V]
        processed = process_logits(logits, batch)
        sampled = _sample(processed, batch)
        if raw_logprobs is None:
            return SamplerOutput(sampled)
        return gather_logprobs(raw_logprobs, sampled, batch.max_num_logprobs)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias / allowed_token_ids / min_tokens masks, then penalties, on a float32 copy.

    Returns ``logits`` itself (any dtype, unmodified) when no row uses any of them.
    """
    if not batch.modifies_logits:
        return logits
    x = logits.to(torch.float32, copy=True)  # [B, V]
    if batch.logit_add_index is not None:
        rows, toks = batch.logit_add_index
        x.index_put_((rows, toks), batch.logit_add_values, accumulate=True)
    if batch.blocked_mask is not None:
        if batch.allowed_rows is None:
            x.masked_fill_(batch.blocked_mask, float("-inf"))
        else:
            sub = x[batch.allowed_rows].masked_fill_(batch.blocked_mask, float("-inf"))
            x.index_copy_(0, batch.allowed_rows, sub)
    if batch.penalties is not None:
        x = _penalize(x, batch.penalties)
    return x


def _penalize(x: torch.Tensor, p: PenaltyTensors) -> torch.Tensor:
    if p.rows is None:
        return apply_penalties(x, p.output_counts, p.prompt_mask, p.presence, p.frequency,
                               p.repetition)
    sub = apply_penalties(x[p.rows], p.output_counts, p.prompt_mask, p.presence, p.frequency,
                          p.repetition)  # [R, V]
    return x.index_copy_(0, p.rows, sub)


def _greedy_tokens(logits: torch.Tensor) -> torch.Tensor:  # -> [B] int64, exact in any float dtype
    """The argmax of each row: on CUDA one launch over many programs (kernels/greedy_argmax.py,
    imported there only, as rng.py imports the seeded race: Triton stays out of `import minivllm`)."""
    if not logits.is_cuda:
        return logits.argmax(dim=-1)
    from minivllm.kernels.greedy_argmax import greedy_argmax
    return greedy_argmax(logits)


def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # -> [B] int64
    greedy = None if batch.all_random else _greedy_tokens(logits)
    if batch.all_greedy:
        return greedy
    assert batch.temperature is not None
    # tensor/tensor promotion makes this float32 even for bf16 logits, and a fresh tensor
    x = logits.div(batch.temperature.unsqueeze(1))  # [B, V]
    x = apply_top_k_top_p_min_p(x, batch.top_k, batch.top_p, batch.min_p, batch.max_top_k)
    probs = x.softmax(dim=-1)
    s = batch.seeds
    random = exponential_race(probs, batch.generator, s.rows if s else None,
                              s.seeds if s else None, s.counters if s else None)
    if greedy is None:
        return random
    return torch.where(batch.greedy_mask, greedy, random)


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> SamplerOutput:
    # logprobs: [B, V] float32 of the raw logits; sampled: [B] int64
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    ranks = (logprobs >= sampled_lp).sum(dim=-1)  # 1-based, as vLLM counts it
    ids, lps = sampled.unsqueeze(1), sampled_lp
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)  # [B, K]
        ids, lps = torch.cat([ids, top_ids], dim=1), torch.cat([lps, top_lp], dim=1)
    return SamplerOutput(sampled, ids, lps, ranks)
