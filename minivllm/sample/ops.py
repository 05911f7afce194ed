"""Batched logits transforms used by the sampler: penalties and top-k / top-p / min-p masks.

Every function works on the whole batch with per-row parameter tensors, on the logits' device.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_penalties(
    logits: torch.Tensor,  # [R, V] float32, modified in place
    output_counts: torch.Tensor,  # [R, V] int, occurrences of each token in the output so far
    prompt_mask: torch.Tensor | None,  # [R, V] bool, token occurs in the prompt; None: no repetition
    presence: torch.Tensor | None,  # [R] float32, 0 = off; None when no row uses it
    frequency: torch.Tensor | None,  # [R] float32, 0 = off; None when no row uses it
    repetition: torch.Tensor | None,  # [R] float32, 1 = off; None when no row uses it
) -> torch.Tensor:
    """vLLM / OpenAI penalties; returns ``logits``.

    repetition (CTRL-style, prompt + output): seen tokens get logit / r if positive, else * r.
    frequency: logit -= f * count(output);  presence: logit -= p * (count(output) > 0).
    """
    in_output = output_counts > 0
    if repetition is not None:
        assert prompt_mask is not None
        seen = in_output | prompt_mask
        scale = torch.where(seen, repetition.unsqueeze(1), 1.0)  # [R, V]
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    if frequency is not None:
        logits -= frequency.unsqueeze(1) * output_counts
    if presence is not None:
        logits -= presence.unsqueeze(1) * in_output
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,  # [B, V] float32 (already divided by temperature), modified in place
    top_k: torch.Tensor | None,  # [B] int64, 0 = off
    top_p: torch.Tensor | None,  # [B] float32 in (0, 1], 1 = off
    min_p: torch.Tensor | None,  # [B] float32 in [0, 1], 0 = off
    max_top_k: int | None = None,  # largest k < V in use; lets top-k alone use topk, not sort
) -> torch.Tensor:
    """Set to -inf every logit outside top-k, then top-p (of the top-k renormalised), then min-p.

    Each filter keeps exactly the tokens whose logit is >= a per-row threshold, so the three
    compose into one threshold (their max) and one masked_fill. Consequences: tokens tied with
    the k-th largest logit are all kept (top-k may keep more than k on exact ties), top-p keeps
    the smallest prefix of the sorted tokens whose mass reaches p plus any token tied with its
    last one, and always keeps at least the most likely token; min-p keeps p_i >= min_p * p_max.
    Returns ``logits``.
    """
    thresholds: list[torch.Tensor] = []  # each [B, 1]
    if top_p is not None:
        sorted_logits = logits.sort(dim=-1, descending=True).values  # [B, V]
        if top_k is not None:
            k_thr = _top_k_threshold(sorted_logits, top_k, logits.shape[-1])
            thresholds.append(k_thr)
            sorted_logits.masked_fill_(sorted_logits < k_thr, _NEG_INF)
        thresholds.append(_top_p_threshold(sorted_logits, top_p))
    elif top_k is not None:
        k = max_top_k if max_top_k is not None else int(top_k.max().item())
        k = min(max(k, 1), logits.shape[-1])
        thresholds.append(_top_k_threshold(logits.topk(k, dim=-1).values, top_k, logits.shape[-1]))
    if min_p is not None:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf keeps all
        max_logit = logits.amax(dim=-1, keepdim=True)
        thresholds.append(max_logit + min_p.log().unsqueeze(1))
    if not thresholds:
        return logits
    threshold = thresholds[0]
    for t in thresholds[1:]:
        threshold = torch.maximum(threshold, t)
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def _top_k_threshold(desc_values: torch.Tensor, top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """desc_values: [B, K'] logits sorted descending, K' >= every k < vocab. -> [B, 1]."""
    width = desc_values.shape[-1]
    idx = (top_k.clamp(1, width) - 1).unsqueeze(1)  # [B, 1]
    kth = desc_values.gather(1, idx)
    off = (top_k <= 0) | (top_k >= vocab)  # 0 = off; k >= V keeps every token
    return kth.masked_fill_(off.unsqueeze(1), _NEG_INF)


def _top_p_threshold(desc_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """desc_logits: [B, V] sorted descending (masked entries -inf). -> [B, 1]."""
    probs = desc_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)  # [B, V] mass of strictly more likely tokens
    keep = mass_before < top_p.unsqueeze(1)  # first column always kept (0 < p)
    # smallest kept logit; robust to a non-monotone float cumsum
    thr = desc_logits.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    return thr.masked_fill_((top_p >= 1.0).unsqueeze(1), _NEG_INF)  # p = 1: row keeps everything
