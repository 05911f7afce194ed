"""The runner's side of speculative decoding: verify a step's proposed tokens, propose the next ones.

With a Speculator every sampling step goes through `verify` (a request without drafts is the
one-row case: plain sampling, the same tokens a seeded or greedy request gets without
speculation), and every request that sampled gets new proposals from `propose`. The scheduler
sees only "k proposed tokens per request" (RunnerOutput.draft_token_ids) and schedules them as
extra query tokens of the request's next step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from minivllm.core.interfaces import TokenLogprobs
from minivllm.sample.batch import SamplingBatch, SamplingRequestState
from minivllm.sample.sampler import gather_logprobs, process_logits
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.proposer import ProposalRequest, Proposer
from minivllm.spec_decode.rejection import VerifyLayout, target_probs, verify

logger = logging.getLogger(__name__)

# Greedy batches without logprobs or a grammar verify on the host (one copy of R argmax ids, a
# few comparisons per request) instead of the device path's ~20 small kernels and two copies:
# at batch 1 a speculative step is launch-bound (issue 19). 0 turns it off (spec_profile.py
# compares both in one lease).
HOST_VERIFY = os.environ.get("MINIVLLM_SPEC_HOST_VERIFY", "1") != "0"


@dataclass
class VerifiedStep:
    tokens: list[list[int]]  # per request, the tokens it gained (1 .. drafts + 1)
    logprobs: list[list[TokenLogprobs] | None] | None
    final_hidden: torch.Tensor  # [B, H] the hidden state of each request's last gained token's row


def row_states(state: SamplingRequestState, drafts: list[int]) -> list[SamplingRequestState]:
    """One sampling state per verify row: row j sees the request's outputs plus drafts[:j] (so
    penalties, min_tokens and the seeded counter are those of the token it decides)."""
    rows = [state]
    for j in range(1, len(drafts) + 1):
        rows.append(SamplingRequestState(state.params, state.prompt_token_ids,
                                         state.output_token_ids + drafts[:j], state.eos_token_ids,
                                         state.sample_index))
    return rows


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    def drop(self, req_ids) -> None:
        self.proposer.drop(req_ids)

    def verify(self, model, hidden: torch.Tensor, states: list[SamplingRequestState], drafts: list[list[int]],
               generator: torch.Generator, logits_hook=None) -> VerifiedStep:
        """hidden: [R, H] the final hidden states of every request's verify rows (1 + its drafts).
        logits_hook(logits [R, V]) changes the logits in place before anything reads them (the
        grammar bitmask of structured outputs)."""
        device = hidden.device
        rows = [r for s, d in zip(states, drafts) for r in row_states(s, d)]
        vocab = model.lm_head.out_features
        batch = SamplingBatch.build(rows, vocab, device, generator)
        if HOST_VERIFY and batch.argmax_of_raw_logits and logits_hook is None:
            return _verify_greedy_on_host(model, hidden, drafts)
        layout = VerifyLayout.build(drafts, device)
        raw_logprobs = probs = argmax = None
        if device.type == "cpu" and batch.argmax_of_raw_logits and logits_hook is None:
            argmax = model.compute_greedy_tokens(hidden)  # the LM head's fused argmax, no logits
        else:
            logits = model.compute_logits(hidden)
            if logits_hook is not None:
                logits_hook(logits)
            if batch.max_num_logprobs is not None:
                raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            processed = process_logits(logits, batch)
            argmax = None if batch.all_random else processed.argmax(dim=-1)
            probs = None if batch.all_greedy else target_probs(processed, batch)
        out = verify(layout, batch, argmax, probs)
        counts = out.num_tokens.tolist()
        tokens = [row[:n] for row, n in zip(out.tokens.tolist(), counts)]
        final_rows = layout.starts + out.num_tokens - 1
        lps = None
        if raw_logprobs is not None:
            lps = _row_logprobs(gather_logprobs(raw_logprobs, out.row_tokens.clamp(min=0), batch.max_num_logprobs),
                                states, drafts, counts)
        return VerifiedStep(tokens, lps, hidden[final_rows])

    def speculates(self, num_sampling_rows: int, drafts: list[list[int]] | None) -> bool:
        """Whether a step goes through verify and propose (SpeculativeConfig.speculates); the
        engine makes the same choice from the schedule to run such a step synchronously."""
        return self.config.speculates(num_sampling_rows, any(drafts or ()))

    def propose(self, req_ids: list[str], states: list[SamplingRequestState], block_ids: list[list[int]],
                final_hidden: torch.Tensor) -> dict[str, list[int]]:
        if not req_ids or not self.config.speculates(len(req_ids), has_drafts=False):  # too many rows to propose for
            return {}
        reqs = [ProposalRequest(r, s.prompt_token_ids, s.output_token_ids, b)
                for r, s, b in zip(req_ids, states, block_ids)]
        drafts = self.proposer.propose(reqs, self.k, final_hidden if self.proposer.needs_hidden else None)
        return {r: d[:self.k] for r, d in zip(req_ids, drafts) if d}


def _verify_greedy_on_host(model, hidden: torch.Tensor, drafts: list[list[int]]) -> VerifiedStep:
    """rejection.verify's greedy rule with the comparisons on the host: request i's rows are its
    1 + len(drafts[i]) consecutive rows; it keeps its drafts while each equals the argmax of the
    row before it, then gains that row's argmax (the correction, or the bonus after all)."""
    argmax = model.compute_greedy_tokens(hidden).tolist()  # [R], the step's one device-to-host copy
    tokens, final_rows, start = [], [], 0
    for d in drafts:
        n = 0
        while n < len(d) and d[n] == argmax[start + n]:
            n += 1
        tokens.append(d[:n] + [argmax[start + n]])
        final_rows.append(start + n)
        start += len(d) + 1
    index = torch.tensor(final_rows, dtype=torch.int64).to(hidden.device, non_blocking=True)
    return VerifiedStep(tokens, None, hidden.index_select(0, index))


def _row_logprobs(out, states, drafts, counts) -> list[list[TokenLogprobs] | None]:
    """Per request the logprobs of each token it gained, from its rows (one host copy)."""
    host = out.to_host()
    result, row = [], 0
    for s, d, n in zip(states, drafts, counts):
        k = s.params.logprobs
        if k is None:
            result.append(None)
        else:
            result.append([TokenLogprobs(host.logprob_token_ids[row + j][:1 + k], host.logprobs[row + j][:1 + k],
                                         host.sampled_ranks[row + j]) for j in range(n)])
        row += len(d) + 1
    return result
