"""Flattens one SchedulerOutput into the tensors of a forward pass (the "super-sequence")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.core.interfaces import PLACEHOLDER_TOKEN, ScheduledRequest


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    # [num_logits] int64: the last token of each sampling request, or with speculative decoding
    # its last 1 + num_draft_tokens tokens (the verify rows, see spec_decode/rejection.py)
    logits_indices: torch.Tensor
    sampling_req_ids: list[str]  # requests that sample this step, in logits order
    # flat positions whose token is PLACEHOLDER_TOKEN, and the request each belongs to
    placeholder_positions: list[int]
    placeholder_req_ids: list[str]
    # speculative decoding: the tokens each sampling request verifies (aligned with
    # sampling_req_ids); None when no request of the step has any
    draft_token_ids: list[list[int]] | None = None
    # [num_requests + 1] each scheduled request's first flat token (the attention metadata's
    # query_start_loc unless the step's verify rows attend as one-token sequences, see below)
    request_starts: list[int] | None = None


def build_step_inputs(
    scheduled: list[ScheduledRequest],
    block_ids: dict[str, list[int]],  # the runner's block table of each request
    block_size: int,
    device: torch.device,
    pin: bool,
) -> StepInputs:
    n = len(scheduled)
    q_lens = np.fromiter((len(s.token_ids) for s in scheduled), dtype=np.int64, count=n)
    starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=n)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    total = int(cu[-1])
    # position of each token: its request's start + its offset inside the request's chunk
    seq_idx = np.repeat(np.arange(n), q_lens)
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, q_lens)
    input_ids = np.fromiter((t for s in scheduled for t in s.token_ids), dtype=np.int64, count=total)

    tables = [block_ids[s.req_id] for s in scheduled]
    max_blocks = max(len(t) for t in tables)
    block_table = np.zeros((n, max_blocks), dtype=np.int32)
    for i, t in enumerate(tables):
        block_table[i, :len(t)] = t
    slot_mapping = block_table[seq_idx, positions // block_size].astype(np.int64) * block_size + positions % block_size
    seq_lens = (starts + q_lens).astype(np.int32)
    sampling = [i for i, s in enumerate(scheduled) if s.samples]
    drafts = None
    if any(s.num_draft_tokens for s in scheduled):
        drafts = [scheduled[i].token_ids[len(scheduled[i].token_ids) - scheduled[i].num_draft_tokens:]
                  for i in sampling]
        # each request's last 1 + k tokens, in order: its end - (k + 1) .. end - 1
        widths = np.asarray([len(d) + 1 for d in drafts], dtype=np.int64)
        first = np.repeat(cu[1:][sampling] - widths, widths)
        within = np.arange(int(widths.sum())) - np.repeat(np.cumsum(widths) - widths, widths)
        logits_indices = first + within
    else:
        logits_indices = cu[1:][sampling] - 1

    att_cu, att_lens, att_table, max_query_len = cu, seq_lens, block_table, int(q_lens.max())
    if drafts is not None and all(s.samples and len(s.token_ids) == s.num_draft_tokens + 1 for s in scheduled):
        # A pure verify step (every request decodes its last token and its drafts): each token
        # attends as a one-token sequence of its own (seq_len = its position + 1, its request's
        # block table), causal by construction. The step is then decode-only: the split-K decode
        # kernel and the decode CUDA graphs, instead of the prefill kernel's one program per
        # (request, kv head) walking the whole context serially (issue 19, batch-1 verify).
        att_cu = np.arange(total + 1, dtype=np.int64)
        att_lens = (positions + 1).astype(np.int32)
        att_table = block_table[seq_idx]
        max_query_len = 1

    def to_dev(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if pin:
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=to_dev(slot_mapping),
        query_start_loc=to_dev(att_cu.astype(np.int32)),
        seq_lens=to_dev(att_lens),
        block_tables=to_dev(att_table),
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=att_cu.tolist(),
        seq_lens_cpu=att_lens.tolist(),
    )
    holes = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN).tolist()
    return StepInputs(to_dev(input_ids), to_dev(positions), meta, to_dev(logits_indices.astype(np.int64)),
                      [scheduled[i].req_id for i in sampling], holes, [scheduled[seq_idx[h]].req_id for h in holes],
                      drafts, cu.tolist())
