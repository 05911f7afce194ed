"""What a step returns besides sampled tokens: prompt logprobs and pooled hidden states.

Both need final hidden states of rows other than the sampling rows, so the runner asks the
model for `sampling rows + extra rows` in one forward pass (`ExtraRows.rows` come after the
logits indices). Prompt logprobs are computed per step, for that step's prompt chunk only, and
the LM head runs on at most PROMPT_LOGPROBS_ROWS rows at a time: a long prompt never
materialises its whole [prompt, vocab] logits matrix.

    chunk of a prompt-logprobs request, positions s .. e-1 (scheduler: rows (first, count))
    position p's logits -> logprob of prompt token p + 1, its rank, and the top-k
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minivllm.core.interfaces import ScheduledRequest, TokenLogprobs

# LM-head rows per call for prompt logprobs: [rows, vocab] float32 logits at a time (a 152k vocab:
# 155 MB at 256 rows)
PROMPT_LOGPROBS_ROWS = 256


@dataclass
class ExtraRows:
    """Rows of a step beyond its sampling rows, and what each group of them is for."""

    rows: list[int] = field(default_factory=list)  # flat token indices into the step
    # (req id, first index into rows, count, target token ids, k)
    prompt_lp: list[tuple[str, int, int, list[int], int]] = field(default_factory=list)
    # (req id, first index into rows, count, this chunk ends the prompt)
    pool: list[tuple[str, int, int, bool]] = field(default_factory=list)


def plan_extra_rows(scheduled: list[ScheduledRequest], cu: list[int], requests: dict) -> ExtraRows | None:
    """cu: the step's query_start_loc on the host; requests: the runner's RunnerRequests."""
    plan = ExtraRows()
    for i, s in enumerate(scheduled):
        if s.prompt_logprob_rows is not None:
            first, count = s.prompt_logprob_rows
            flat = cu[i] + first - s.num_computed_tokens
            state = requests[s.req_id].sampling
            targets = state.prompt_token_ids[first + 1:first + 1 + count]
            plan.prompt_lp.append((s.req_id, len(plan.rows), count, targets, state.params.prompt_logprobs))
            plan.rows.extend(range(flat, flat + count))
        pooling = requests[s.req_id].pooling
        if pooling is not None and (s.pool or pooling.pooling_type == "MEAN"):
            lo = cu[i + 1] - 1 if pooling.pooling_type == "LAST" else cu[i]
            plan.pool.append((s.req_id, len(plan.rows), cu[i + 1] - lo, s.pool))
            plan.rows.extend(range(lo, cu[i + 1]))
    return plan if plan.rows else None


def prompt_logprobs(model, hidden: torch.Tensor, plan: ExtraRows) -> dict[str, list[TokenLogprobs]]:
    """hidden: [len(plan.rows), H]. For each prompt-logprobs group: per row the logprob of the
    next prompt token, its rank (1 = most likely) and the top-k, from the raw logits."""
    if not plan.prompt_lp:
        return {}
    idx = torch.cat([torch.arange(o, o + c) for _, o, c, _, _ in plan.prompt_lp]).to(hidden.device)
    targets = torch.tensor([t for *_, tg, _ in plan.prompt_lp for t in tg], dtype=torch.int64, device=hidden.device)
    k = max(g[4] for g in plan.prompt_lp)
    lp_t, rank_t, top_lp, top_ids = [], [], [], []
    for lo in range(0, idx.shape[0], PROMPT_LOGPROBS_ROWS):
        h = hidden[idx[lo:lo + PROMPT_LOGPROBS_ROWS]]
        logprobs = torch.log_softmax(model.compute_logits(h), dim=-1, dtype=torch.float32)  # [r, V]
        tgt = logprobs.gather(1, targets[lo:lo + PROMPT_LOGPROBS_ROWS].unsqueeze(1))  # [r, 1]
        lp_t.append(tgt[:, 0])
        rank_t.append((logprobs >= tgt).sum(-1))
        if k > 0:
            v, i = logprobs.topk(k, dim=-1)
            top_lp.append(v)
            top_ids.append(i)
    lp_h, rank_h = torch.cat(lp_t).tolist(), torch.cat(rank_t).tolist()
    top_lp_h = torch.cat(top_lp).tolist() if k > 0 else None
    top_ids_h = torch.cat(top_ids).tolist() if k > 0 else None
    out, row = {}, 0
    for req_id, _, count, tgt, kk in plan.prompt_lp:
        entries = []
        for j in range(count):
            ids, vals = [tgt[j]], [lp_h[row]]
            if kk > 0:
                ids += top_ids_h[row][:kk]
                vals += top_lp_h[row][:kk]
            entries.append(TokenLogprobs(ids, vals, rank_h[row]))
            row += 1
        out[req_id] = entries
    return out


def pool(hidden: torch.Tensor, plan: ExtraRows, requests: dict) -> dict[str, list[float]]:
    """Pooling rows -> the finished requests' vectors. MEAN sums every chunk's rows into the
    request's float32 accumulator (chunks arrive in order); LAST takes the final row."""
    out = {}
    for req_id, offset, count, final in plan.pool:
        r = requests[req_id]
        rows = hidden[offset:offset + count].float()
        if r.pooling.pooling_type == "MEAN":
            r.pool_sum = rows.sum(0) if r.pool_sum is None else r.pool_sum + rows.sum(0)
            r.pool_count += count
            if not final:
                continue
            vec = r.pool_sum / r.pool_count
        else:
            vec = rows[-1]
        if r.pooling.normalize:
            vec = F.normalize(vec, dim=-1)
        out[req_id] = vec.tolist()
    return out
