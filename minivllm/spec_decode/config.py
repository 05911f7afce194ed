"""Speculative decoding options, vLLM's shape: `LLM(..., speculative_config={...})` and
`minivllm serve --speculative-config '<json>'`.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": 8}            # dynamic length, up to the limit
    {"model": "path/to/draft", "num_speculative_tokens": 4}      # a separate draft model
    {"method": "layer_skip", "num_layers": 8, "num_speculative_tokens": 3}
    {"method": "medusa", "model": "path/to/heads", "num_speculative_tokens": 3}

A config naming only a `model` is the draft-model method ("draft_model"), as in vLLM.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "draft_model", "layer_skip", "medusa")
MAX_SPECULATIVE_TOKENS = 16  # verify rows per request a step; more costs more than it can win


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft model (draft_model) or heads directory (medusa)
    prompt_lookup_min: int = 2  # ngram: shortest suffix of the context to look up
    prompt_lookup_max: int = 5  # ngram: longest
    num_layers: int | None = None  # layer_skip: the target's first layers that draft
    # suffix decoding (vLLM's names): tree depth, cached earlier requests, how many tokens a
    # match of length L may speculate (factor * L), lowest path probability to keep speculating
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # no drafts while more than this many requests sample in a step (vLLM's field; a batch that
    # fills the GPU gains nothing from verify rows, and such steps run as plain ones: async
    # scheduling, no verify or propose on the host). Absent: DEFAULT_DISABLE_BY_BATCH_SIZE;
    # None (explicitly): always speculate, as vLLM does by default
    disable_by_batch_size: int | None = None

    def speculates(self, num_sampling_rows: int, has_drafts: bool) -> bool:
        """Whether a step verifies or proposes: it has drafts to verify, or few enough rows to
        propose for. Such a step runs synchronously (the next one is scheduled with its
        proposals); any other step is a plain one."""
        limit = self.disable_by_batch_size
        return has_drafts or limit is None or num_sampling_rows <= limit

    @property
    def uses_draft_kv(self) -> bool:
        """The proposer writes K/V past the scheduled tokens (its own forward passes)."""
        return self.method in ("draft_model", "layer_skip")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past a step's scheduled tokens that the proposer's forward passes write:
        the bonus token and the k - 1 drafts it feeds back (see spec_decode/model_proposer.py)."""
        return self.num_speculative_tokens if self.uses_draft_kv else 0


# no drafts above this many sampling rows unless the config says otherwise: W8 on an H100 (default
# model, 2026-11-26) ran 0.58x of no speculation at batch 32 with n-gram drafts, at batch 1 0.90x
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


def _check(ok: bool, field: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{field} {msg}")


def parse_speculative_config(value, num_target_layers: int) -> SpeculativeConfig | None:
    """A dict, a JSON string or None -> a validated SpeculativeConfig (or None: no speculation).
    Checks what needs no model loading; the draft's vocabulary is checked when it loads."""
    if value is None or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if isinstance(value, SpeculativeConfig):
        return value
    _check(isinstance(value, dict), "", f"must be a dict or a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    _check(not unknown, unknown[0] if unknown else "", f"is not a speculative_config field (known: {sorted(known)})")
    value = dict(value)
    method = value.pop("method", None) or ("draft_model" if value.get("model") else None)
    _check(method in METHODS, "method", f"must be one of {list(METHODS)} (or give a draft 'model'), got {method!r}")
    k = value.pop("num_speculative_tokens", None)
    if k is None and method == "suffix":
        k = 8
    _check(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
           "num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    value.setdefault("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)  # an explicit None stays None
    cfg = SpeculativeConfig(method=method, num_speculative_tokens=k, **value)
    _validate_method(cfg, num_target_layers)
    return cfg


def _validate_method(cfg: SpeculativeConfig, num_target_layers: int) -> None:
    if cfg.method == "ngram":
        _check(1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max, "prompt_lookup_min",
               f"must be >= 1 and <= prompt_lookup_max={cfg.prompt_lookup_max}, got {cfg.prompt_lookup_min}")
    if cfg.method in ("draft_model", "medusa"):
        _check(isinstance(cfg.model, str) and bool(cfg.model), "model", f"must name a path for method {cfg.method!r}")
        _check(os.path.exists(cfg.model), "model", f"path does not exist: {cfg.model!r}")
    if cfg.method == "layer_skip":
        n = cfg.num_layers
        _check(isinstance(n, int) and 1 <= n < num_target_layers, "num_layers",
               f"must be an integer in [1, {num_target_layers - 1}] (the target has {num_target_layers} layers), "
               f"got {n!r}")
    if cfg.method == "suffix":
        _check(cfg.suffix_decoding_max_tree_depth >= 1, "suffix_decoding_max_tree_depth", "must be >= 1")
        _check(cfg.suffix_decoding_max_cached_requests >= 0, "suffix_decoding_max_cached_requests", "must be >= 0")
        _check(0.0 <= cfg.suffix_decoding_min_token_prob <= 1.0, "suffix_decoding_min_token_prob",
               "must be in [0, 1]")
    if cfg.disable_by_batch_size is not None:
        _check(cfg.disable_by_batch_size >= 1, "disable_by_batch_size", f"must be >= 1, got {cfg.disable_by_batch_size}")
