"""The grammar backend interface and its registry (backends are imported lazily, by name).

A backend turns a request's constraint into a compiled grammar once (cached by the manager by
`GrammarKey`) and gives each sequence its own matcher over it. Adding a backend (llguidance,
outlines-core) is one file implementing `GrammarBackend` and `GrammarMatcher` plus a line in
`_BACKENDS`.
"""

from __future__ import annotations

import importlib
import json
import threading
from collections import OrderedDict
from typing import Any, NamedTuple, Protocol

from minivllm.sampling_params import StructuredOutputsParams


class GrammarKey(NamedTuple):
    """What a compiled grammar depends on: the constraint kind, its text, and the options that
    change the grammar. Equal keys share one compiled grammar."""

    kind: str  # json | json_object | regex | choice | grammar | structural_tag
    spec: str  # the schema as JSON text, the regex, the grammar... ("" for json_object)
    any_whitespace: bool = True  # json / json_object: optional whitespace between tokens
    no_additional_properties: bool = False  # json: objects with `properties` take no other keys


def grammar_key(so: StructuredOutputsParams) -> GrammarKey:
    kind = so.kind
    value = getattr(so, kind)
    if kind == "json":
        spec = value if isinstance(value, str) else json.dumps(value)
    elif kind == "json_object":
        spec = ""
    elif kind == "choice":
        spec = json.dumps(list(value))  # a list of strings, unambiguously as text
    else:
        spec = value
    return GrammarKey(kind, spec, not so.disable_any_whitespace, so.disable_additional_properties)


class GrammarMatcher(Protocol):
    """One sequence's position in a compiled grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative decoding's rejected drafts)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has ended (a stop token was accepted at an end state)."""
        ...


class GrammarBackend(Protocol):
    """Compiles constraints for one tokenizer and fills token bitmasks.

    A bitmask is int32 [rows, ceil(vocab_size / 32)] on the host: bit j of word w of a row is
    1 when token 32 * w + j is allowed next (tokens past the tokenizer's vocabulary, i.e. the
    model's padding, are never allowed)."""

    name: str

    @staticmethod
    def validate(so: StructuredOutputsParams) -> None:
        """Cheap checks without a tokenizer (ValueError naming the field, with the position):
        run when the request is added, so bad input never reaches the compile pool."""
        ...

    def compile(self, key: GrammarKey) -> Any:
        """The compiled grammar (slow: runs on the manager's thread pool)."""
        ...

    def new_matcher(self, compiled: Any) -> GrammarMatcher: ...

    def allocate_bitmask(self, rows: int, pin: bool) -> Any: ...

    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: Any) -> None:
        """Row i of `bitmask` <- the tokens matchers[i] allows next, for the whole batch at once."""
        ...


# name -> "module:class"; a backend's module (and its library) is imported only when chosen
_BACKENDS = {
    "xgrammar": "minivllm.structured.xgrammar_backend:XgrammarBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend_class(name: str) -> type:
    """The backend class; a ValueError if unknown or if its library is not installed."""
    if name not in _BACKENDS:
        raise ValueError(f"structured_outputs_config.backend must be one of {available_backends()}, got {name!r}")
    module_name, cls_name = _BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"structured outputs need the {name} package, which is not installed ({e})") from None
    return getattr(module, cls_name)


VALIDATED_SPECS = 512  # specs remembered as valid (least recently used go first)
_validated: OrderedDict[tuple[str, GrammarKey], None] = OrderedDict()
_validated_lock = threading.Lock()


def validate_spec(backend: str, so: StructuredOutputsParams) -> None:
    """The backend's validate(so) (a ValueError naming the field), once per spec: a spec that
    passed is remembered in an LRU shared by the server's request checks and the engine's, so a
    repeated schema is not checked again. Why: the JSON Schema meta-validation took ~4 ms a
    request for W7's schemas, 0.7 s of a 13.4 s run before its first step (issue 18, lease 14),
    and on the server it runs in the request handler. A spec that fails is checked every time."""
    key = (backend, grammar_key(so))
    with _validated_lock:
        if key in _validated:
            _validated.move_to_end(key)
            return
    get_backend_class(backend).validate(so)
    with _validated_lock:
        _validated[key] = None
        while len(_validated) > VALIDATED_SPECS:
            _validated.popitem(last=False)


class FastestOf:
    """Picks, step by step, the cheaper of two ways to do the same work, by measurement: each
    way is tried PROBES times first, then the one with the lower running mean cost is used, and
    the other is tried again every REPROBE_EVERY picks (costs drift with the batch's grammars).

    Used for the bitmask fill: xgrammar's thread pool pays for itself only when the host has
    idle cores and each row's mask is costly; on a busy or small host one thread is faster
    (measured on the 2-core CI machine: 256 W7 rows, 3.6 ms in one thread vs 5.6 ms in two)."""

    PROBES = 3
    REPROBE_EVERY = 64
    DECAY = 0.5  # weight of the old mean in the running mean

    def __init__(self, ways: tuple[str, str]) -> None:
        self.ways = ways
        self.cost = {w: None for w in ways}
        self.tries = {w: 0 for w in ways}
        self.picks = 0

    def pick(self) -> str:
        self.picks += 1
        for w in self.ways:
            if self.tries[w] < self.PROBES:
                return w
        best, other = sorted(self.ways, key=lambda w: self.cost[w])
        return other if self.picks % self.REPROBE_EVERY == 0 else best

    def record(self, way: str, cost: float) -> None:
        old = self.cost[way]
        self.cost[way] = cost if old is None else self.DECAY * old + (1 - self.DECAY) * cost
        self.tries[way] += 1
