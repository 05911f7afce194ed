"""SamplingParams: how one request is sampled and when it stops (mirrors vLLM's), and
StructuredOutputsParams: the constraint a request's output must follow (vLLM's field names)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: top logprobs per token, generated or prompt

# the constraint kinds of StructuredOutputsParams, exactly one of which is set
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's StructuredOutputsParams): exactly one of
    json (a JSON Schema, as a dict or its text), json_object=True (any JSON object), regex,
    choice (one of these strings), grammar (EBNF/GBNF, or Lark text) or structural_tag (xgrammar's
    structural tag, JSON text). The engine checks that the constraint compiles when the request
    is added (a ValueError naming the field, with the position where the text is wrong)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace: one space after "," and ":" (as vLLM)
    disable_additional_properties: bool = False  # objects with `properties` take no other keys

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Exactly one constraint kind, of the right type; the compile check is the backend's."""
        given = self._given()
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            _check_so(False, given[1] if given else "json",
                      f"conflicts: give exactly one constraint kind of {', '.join(STRUCTURED_KINDS)}; got {named}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            _check_so(isinstance(value, (str, dict)), kind, f"must be a JSON Schema (dict or str), got {type(value).__name__}")
        elif kind == "json_object":
            _check_so(value is True, kind, f"must be True when given, got {value!r}")
        elif kind == "choice":
            _check_so(isinstance(value, (list, tuple)) and len(value) > 0, kind, "must be a non-empty list of strings")
            bad = next((c for c in value if not isinstance(c, str)), None)
            _check_so(bad is None, kind, f"must hold strings only, got {bad!r}")
        else:
            _check_so(isinstance(value, str) and value.strip() != "", kind, f"must be a non-empty string, got {value!r}")

    def _given(self) -> list[str]:
        return [k for k in STRUCTURED_KINDS if getattr(self, k) is not None and getattr(self, k) is not False]

    @property
    def kind(self) -> str:
        """Which constraint is set (one of STRUCTURED_KINDS)."""
        return self._given()[0]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        """From a request's `structured_outputs` object; unknown keys are a ValueError."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        _check_so(not unknown, unknown[0] if unknown else "", f"is not a field of structured_outputs "
                  f"(fields: {', '.join(sorted(names))})")
        return cls(**d)


def _check_so(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.structured_outputs.{name} {msg}")


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output holds all text and tokens so far (streaming default)
    DELTA = 1  # every output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes (offline batches)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token (plus the sampled one)
    # number of top logprobs per prompt token (plus the prompt token itself); computed during prefill
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's free-form per-request arguments; "kv_transfer_params" carries disaggregated
    # prefill/decode's hand-off (kv_transfer/params.py)
    extra_args: dict[str, Any] | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
               f"must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                   f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None:
                _check(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_LOGPROBS, name,
                       f"must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids",
                   "must not be empty (it would allow no token at all); leave it out for no restriction")
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        for s in self.stop_strings:
            _check(isinstance(s, str) and len(s) > 0, "stop", f"must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check(isinstance(t, int) and t >= 0, "stop_token_ids", f"must hold token ids >= 0, got {t!r}")
        if self.extra_args is not None:
            _check(isinstance(self.extra_args, dict), "extra_args", f"must be a dict, got {type(self.extra_args).__name__}")
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                   f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()

    @property
    def uses_penalties(self) -> bool:
        """Penalties depend on the exact tokens generated so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        return SamplingParams(**{k: v for k, v in self.__dict__.items() if k != "stop_strings"})


def _check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {msg}")


@dataclass
class BeamSearchParams:
    """Beam search (mirrors vLLM's): keep the `beam_width` most likely sequences, each step
    extending every beam by its 2 * beam_width most likely tokens. A beam that emits eos is
    complete (unless ignore_eos); at max_tokens the complete and running beams are ranked by
    cum_logprob / len(prompt + output) ** length_penalty (eos not counted). temperature 0 ranks by
    the model's log-probabilities, T > 0 by log_softmax(logits / T)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY  # beams change until the end

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_beam(isinstance(self.beam_width, int) and not isinstance(self.beam_width, bool)
                    and self.beam_width >= 1, "beam_width", f"must be an integer >= 1, got {self.beam_width!r}")
        _check_beam(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
                    and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check_beam(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check_beam(self.length_penalty == self.length_penalty, "length_penalty", "must be a number, got NaN")

    @property
    def n(self) -> int:
        return self.beam_width

    def clone(self) -> BeamSearchParams:
        return BeamSearchParams(**self.__dict__)


def _check_beam(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"BeamSearchParams.{name} {msg}")
