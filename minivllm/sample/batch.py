"""Per-step sampling tensors for the whole batch, built from the requests' SamplingParams.

The builder runs on the host once per step and moves a handful of small tensors to the
device. Everything optional is None when no row uses it, so a temperature-only batch costs
one [B] float32 tensor (and an all-greedy batch none at all). Sparse per-row data uses the
convention ``rows = None`` for "every row of the batch" and otherwise an int64 index [R].
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import reduce
from operator import and_, or_
from typing import NamedTuple

import torch
from torch.nn.utils.rnn import pad_sequence

from minivllm.sample.rng import wrap_seed
from minivllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


# RowParams.flags bits: which optional features a row uses. The builder ORs / ANDs them over
# the batch and touches the other columns only when some row sets the bit.
(F_GREEDY, F_TOP_K, F_TOP_P, F_MIN_P, F_SEED, F_BIAS, F_MIN_TOKENS, F_ALLOWED, F_PENALTY,
 F_LOGPROBS) = (1 << i for i in range(10))


class RowParams(NamedTuple):
    """The per-row scalars the builder reads, derived once per sequence from its params."""

    flags: int  # F_* bits
    temperature: float  # 1.0 on greedy rows (they never divide)
    top_k: int  # 0 = off (always off on greedy rows, like top_p / min_p)
    top_p: float  # 1.0 = off
    min_p: float  # 0.0 = off
    seed: int  # params.seed + sample_index wrapped to int64 (if F_SEED)
    logprobs: int  # -1 = none


@dataclass(slots=True)
class SamplingRequestState:
    """What the sampler needs from one running sequence (one of a request's n samples).

    ``params`` and ``sample_index`` must not change after construction (``row`` caches them).
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)  # generated so far; grows
    eos_token_ids: Collection[int] = ()  # the model's eos tokens
    sample_index: int = 0  # which of the n samples; a seeded sample uses seed + sample_index
    num_pending: int = 0  # tokens sampled by launched steps, not yet appended (async scheduling)
    row: RowParams = field(init=False, repr=False)
    # host-side caches, filled on first use: the step-to-step cost is then a concatenation
    _prompt_ids: torch.Tensor | None = field(init=False, default=None, repr=False)
    _allowed_ids: torch.Tensor | None = field(init=False, default=None, repr=False)
    _bias: tuple[list[int], list[float]] | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.row = _row_params(self.params, self.sample_index)

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far, including those of steps still running (their values may be
        unknown; penalties, which need the values, are only used with none pending)."""
        return len(self.output_token_ids) + self.num_pending

    def unique_prompt_ids(self) -> torch.Tensor:
        """Distinct prompt token ids as a CPU int64 tensor, computed once (repetition penalty)."""
        if self._prompt_ids is None:
            self._prompt_ids = torch.tensor(sorted(set(self.prompt_token_ids)), dtype=torch.int64)
        return self._prompt_ids

    def allowed_ids(self, vocab_size: int) -> torch.Tensor:
        """allowed_token_ids as a CPU int64 tensor, checked against the vocab once."""
        if self._allowed_ids is None:
            ids = self.params.allowed_token_ids or []
            for t in ids:
                _check_token(t, vocab_size, "allowed_token_ids")
            self._allowed_ids = torch.tensor(ids, dtype=torch.int64)
        return self._allowed_ids

    def logit_bias(self, vocab_size: int) -> tuple[list[int], list[float]]:
        """logit_bias as (token ids, values), checked against the vocab once."""
        if self._bias is None:
            bias = self.params.logit_bias or {}
            for t in bias:
                _check_token(t, vocab_size, "logit_bias")
            self._bias = (list(bias), [float(b) for b in bias.values()])
        return self._bias


def _row_params(p: SamplingParams, sample_index: int) -> RowParams:
    g = p.greedy  # greedy rows get neutral values: they never read the random path
    flags = (
        (F_GREEDY if g else 0)
        | (F_TOP_K if not g and p.top_k > 0 else 0)
        | (F_TOP_P if not g and p.top_p < 1.0 else 0)
        | (F_MIN_P if not g and p.min_p > 0.0 else 0)
        | (F_SEED if not g and p.seed is not None else 0)
        | (F_BIAS if p.logit_bias else 0)
        | (F_MIN_TOKENS if p.min_tokens > 0 else 0)
        | (F_ALLOWED if p.allowed_token_ids else 0)
        | (F_PENALTY if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                         or p.repetition_penalty != 1.0) else 0)
        | (F_LOGPROBS if p.logprobs is not None else 0)
    )
    return RowParams(
        flags=flags, temperature=1.0 if g else p.temperature, top_k=0 if g else p.top_k,
        top_p=1.0 if g else p.top_p, min_p=0.0 if g else p.min_p,
        seed=wrap_seed(p.seed + sample_index) if flags & F_SEED else 0,
        logprobs=-1 if p.logprobs is None else p.logprobs,
    )


@dataclass(slots=True)
class SeedTensors:
    rows: torch.Tensor | None  # [R] int64 seeded rows; None = every row
    seeds: torch.Tensor  # [R] int64: params.seed + sample_index, wrapped to int64
    counters: torch.Tensor  # [R] int64: tokens generated so far (the step of the request)


@dataclass(slots=True)
class PenaltyTensors:
    rows: torch.Tensor | None  # [R] int64 rows using a penalty; None = every row
    output_counts: torch.Tensor  # [R, V] int32 occurrences in the output so far
    prompt_mask: torch.Tensor | None  # [R, V] bool in prompt; only if a row has repetition
    presence: torch.Tensor | None  # [R] float32 (None: no row uses it)
    frequency: torch.Tensor | None  # [R] float32
    repetition: torch.Tensor | None  # [R] float32


@dataclass(slots=True)
class SamplingBatch:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    generator: torch.Generator | None = None  # unseeded random rows; on the logits' device
    temperature: torch.Tensor | None = None  # [B] float32, greedy rows 1.0; None if all greedy
    greedy_mask: torch.Tensor | None = None  # [B] bool; only in mixed greedy/random batches
    top_k: torch.Tensor | None = None  # [B] int64, 0 = off
    max_top_k: int | None = None
    top_p: torch.Tensor | None = None  # [B] float32, 1 = off
    min_p: torch.Tensor | None = None  # [B] float32, 0 = off
    seeds: SeedTensors | None = None
    penalties: PenaltyTensors | None = None
    # (row, token) pairs added to the logits: logit_bias values, -inf for min_tokens stops
    logit_add_index: torch.Tensor | None = None  # [2, N] int64
    logit_add_values: torch.Tensor | None = None  # [N] float32
    allowed_rows: torch.Tensor | None = None  # [A] int64 rows with allowed_token_ids; None = all
    blocked_mask: torch.Tensor | None = None  # [A, V] bool: True = not an allowed token
    max_num_logprobs: int | None = None  # K of the logprobs output; None: no row asks

    @property
    def modifies_logits(self) -> bool:
        """True when masks or penalties change the logits before greedy/random sampling."""
        return (self.logit_add_index is not None or self.blocked_mask is not None
                or self.penalties is not None)

    @property
    def argmax_of_raw_logits(self) -> bool:
        """True when every row's token is the argmax of its raw logits and nothing else is asked
        of them (all greedy, no masks or penalties, no logprobs): the runner may then take the
        argmax without the logits (models/cpu_linear.py)."""
        return self.all_greedy and not self.modifies_logits and self.max_num_logprobs is None

    @classmethod
    def build(
        cls,
        states: Sequence[SamplingRequestState],
        vocab_size: int,
        device: torch.device | str,
        generator: torch.Generator | None = None,
    ) -> SamplingBatch:
        """Row i of the batch is states[i]; vocab_size is the logits' last dimension.

        Raises ValueError on logit_bias / allowed_token_ids outside the vocab. On CUDA the
        copies are non_blocking from pinned memory: build before or while the forward runs.
        """
        device = torch.device(device)
        if not states:
            return cls(num_rows=0, vocab_size=vocab_size, all_greedy=True, all_random=False)
        rows = [s.row for s in states]
        flags = [r.flags for r in rows]
        used, common = reduce(or_, flags), reduce(and_, flags)  # bits set by some / every row
        batch = cls(num_rows=len(rows), vocab_size=vocab_size, all_greedy=bool(common & F_GREEDY),
                    all_random=not used & F_GREEDY, generator=generator)
        if not batch.all_greedy:
            _fill_random_params(batch, rows, flags, used, device)
        if used & F_SEED:
            batch.seeds = _build_seeds(states, flags, device)
        if used & (F_BIAS | F_MIN_TOKENS):
            _fill_logit_adds(batch, states, flags, device)
        if used & F_ALLOWED:
            _fill_allowed(batch, states, flags, device)
        if used & F_PENALTY:
            batch.penalties = _build_penalties(states, flags, vocab_size, device)
        if used & F_LOGPROBS:
            batch.max_num_logprobs = max(r.logprobs for r in rows)
        return batch


def validate_for_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Token-id checks that need the model's vocab; call at the request boundary."""
    for t in (params.logit_bias or {}):
        _check_token(t, vocab_size, "logit_bias")
    if params.allowed_token_ids is not None:
        if len(params.allowed_token_ids) == 0:
            raise ValueError("SamplingParams.allowed_token_ids must not be empty")
        for t in params.allowed_token_ids:
            _check_token(t, vocab_size, "allowed_token_ids")


def _check_token(token: int, vocab_size: int, name: str) -> None:
    if not (isinstance(token, int) and 0 <= token < vocab_size):
        raise ValueError(f"SamplingParams.{name} holds token id {token!r}, "
                         f"outside the vocabulary [0, {vocab_size})")


def _fill_random_params(batch: SamplingBatch, rows: list[RowParams], flags: list[int],
                        used: int, device: torch.device) -> None:
    """temperature, and top-k/top-p/min-p only if some random row uses them."""
    cols = [[r.temperature for r in rows]]
    if used & F_TOP_P:
        cols.append([r.top_p for r in rows])
    if used & F_MIN_P:
        cols.append([r.min_p for r in rows])
    packed = _to_device(cols, "f", torch.float32, device)  # [F, B]: one copy
    batch.temperature = packed[0]
    if used & F_TOP_P:
        batch.top_p = packed[1]
    if used & F_MIN_P:
        batch.min_p = packed[-1]
    if used & F_TOP_K:
        ks = [r.top_k if r.top_k < batch.vocab_size else 0 for r in rows]  # k >= V keeps all
        if any(ks):
            batch.top_k = _to_device([ks], "q", torch.int64, device)[0]
            batch.max_top_k = max(ks)
    if not batch.all_random:
        greedy = [bool(f & F_GREEDY) for f in flags]
        batch.greedy_mask = _to_device([greedy], "b", torch.bool, device)[0]


def _build_seeds(states: Sequence[SamplingRequestState], flags: list[int],
                 device: torch.device) -> SeedTensors:
    rows = [i for i, f in enumerate(flags) if f & F_SEED]
    seeds = [states[i].row.seed for i in rows]
    counters = [states[i].num_generated for i in rows]  # the request's step
    packed = _to_device([seeds, counters], "q", torch.int64, device)  # [2, R]
    return SeedTensors(rows=_rows_index(rows, len(states), device),
                       seeds=packed[0], counters=packed[1])


def _fill_logit_adds(batch: SamplingBatch, states: Sequence[SamplingRequestState],
                     flags: list[int], device: torch.device) -> None:
    """logit_bias entries, and -inf on stop/eos tokens of rows still below min_tokens."""
    rows: list[int] = []
    toks: list[int] = []
    vals: list[float] = []
    for i, f in enumerate(flags):
        if f & F_BIAS:
            bias_toks, bias_vals = states[i].logit_bias(batch.vocab_size)
            rows.extend([i] * len(bias_toks))
            toks.extend(bias_toks)
            vals.extend(bias_vals)
        if f & F_MIN_TOKENS and states[i].num_generated < states[i].params.min_tokens:
            stops = _stop_tokens(states[i], batch.vocab_size)
            rows.extend([i] * len(stops))
            toks.extend(stops)
            vals.extend([_NEG_INF] * len(stops))
    if rows:
        batch.logit_add_index = _to_device([rows, toks], "q", torch.int64, device)  # [2, N]
        batch.logit_add_values = _to_device([vals], "f", torch.float32, device)[0]


def _stop_tokens(s: SamplingRequestState, vocab_size: int) -> list[int]:
    """Token ids that would end the request (ids the model cannot emit are left out)."""
    stops = set(s.params.stop_token_ids or ())
    if not s.params.ignore_eos:
        stops.update(s.eos_token_ids)
    return [t for t in stops if 0 <= t < vocab_size]


def _fill_allowed(batch: SamplingBatch, states: Sequence[SamplingRequestState],
                  flags: list[int], device: torch.device) -> None:
    # None or [] (the latter rejected by validate_for_vocab) means no restriction
    rows = [i for i, f in enumerate(flags) if f & F_ALLOWED]
    v = batch.vocab_size
    ids = pad_sequence([states[i].allowed_ids(v) for i in rows], batch_first=True,
                       padding_value=v)  # [A, L]; the pad lands in the extra column v
    blocked = torch.ones(len(rows), v + 1, dtype=torch.bool, device=device)
    batch.blocked_mask = blocked.scatter_(1, _h2d(ids, device), False)[:, :v]
    batch.allowed_rows = _rows_index(rows, len(states), device)


def _build_penalties(states: Sequence[SamplingRequestState], flags: list[int], vocab_size: int,
                     device: torch.device) -> PenaltyTensors:
    """Token counts by scatter_add over a padded [R, L] token tensor (pad -> column V)."""
    rows = [i for i, f in enumerate(flags) if f & F_PENALTY]
    params = [states[i].params for i in rows]
    out_ids = _padded([states[i].output_token_ids for i in rows], pad=vocab_size, device=device)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.int32))
    pres = [p.presence_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    rep = [p.repetition_penalty for p in params]
    packed = _to_device([pres, freq, rep], "f", torch.float32, device)  # [3, R]
    use_rep = any(r != 1.0 for r in rep)
    prompt_mask = None
    if use_rep:
        prompt_ids = _h2d(pad_sequence([states[i].unique_prompt_ids() for i in rows],
                                       batch_first=True, padding_value=vocab_size), device)
        prompt_mask = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
        prompt_mask = prompt_mask.scatter_(1, prompt_ids, True)[:, :vocab_size]
    return PenaltyTensors(
        rows=_rows_index(rows, len(states), device),
        output_counts=counts[:, :vocab_size],
        prompt_mask=prompt_mask,
        presence=packed[0] if any(pres) else None,
        frequency=packed[1] if any(freq) else None,
        repetition=packed[2] if use_rep else None,
    )


def _rows_index(rows: list[int], num_rows: int, device: torch.device) -> torch.Tensor | None:
    """None when the rows are the whole batch (lets the sampler skip a gather/scatter)."""
    if len(rows) == num_rows:
        return None
    return _to_device([rows], "q", torch.int64, device)[0]


def _to_device(cols: Sequence[Sequence], typecode: str, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """Equal-length host columns -> [F, N] tensor, one copy. array.array + frombuffer is a
    few times faster than torch.tensor on a list; on the CPU the result shares the array."""
    buf = array(typecode)
    for c in cols:
        buf.extend(c)
    return _h2d(torch.frombuffer(buf, dtype=dtype).view(len(cols), -1), device)


def _h2d(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device. On CUDA through pinned memory and non_blocking, so building a
    batch never waits for the kernels already queued (a pageable copy would)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _padded(lists: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Ragged token lists -> [R, max_len] int64 padded with ``pad``; one host-to-device copy."""
    width = max((len(x) for x in lists), default=0)
    if width == 0:
        return torch.empty((len(lists), 0), dtype=torch.int64, device=device)
    buf = array("q")
    for x in lists:
        buf.extend(x)
        buf.extend([pad] * (width - len(x)))
    return _h2d(torch.frombuffer(buf, dtype=torch.int64).view(len(lists), width), device)
