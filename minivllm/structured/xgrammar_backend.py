"""The xgrammar backend (vLLM's and SGLang's default): JSON Schema, regex, EBNF (and Lark,
converted), choices and structural tags, compiled against the tokenizer's vocabulary; token
bitmasks filled for the whole batch by xgrammar's threads.

Works with xgrammar 0.2.5.post1 (what vLLM 0.20.0 ships) up to 0.2.x."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import xgrammar as xgr

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured.backend import FastestOf, GrammarKey
from minivllm.structured.json_schema import check_schema, forbid_additional_properties, parse_schema
from minivllm.structured.lark import ebnf_string, is_lark, lark_to_ebnf

# below this many rows one thread fills the bitmask: handing work to xgrammar's threads costs more
PARALLEL_FILL_MIN_ROWS = 16
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[13:36:17] /project/cpp/x.cc:75: "


def _reason(e: BaseException) -> str:
    """xgrammar's message without its log prefix (the position stays)."""
    return _LOG_PREFIX.sub("", str(e).strip())


class XgrammarMatcher:
    """A GrammarMatcher over xgrammar's (stop tokens: the model's eos tokens)."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        # vocab_size: the model's (the logits' width), may exceed the tokenizer's: xgrammar masks
        # the padding ids
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids)
        threads = max(1, min(8, os.cpu_count() or 1))
        # its own cache stays off: the manager caches compiled grammars by GrammarKey
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._fill_choice = FastestOf(("threads", "serial"))

    # ---- validation (no tokenizer) ------------------------------------------------------------
    @staticmethod
    def validate(so: StructuredOutputsParams) -> None:
        kind = so.kind
        try:
            if kind == "json":
                schema = parse_schema(so.json)
                check_schema(schema)
                xgr.Grammar.from_json_schema(json.dumps(schema))
            elif kind == "regex":
                if "\x00" in so.regex:
                    raise ValueError("contains a NUL character")
                xgr.Grammar.from_regex(so.regex)
            elif kind in ("grammar", "choice"):
                xgr.Grammar.from_ebnf(_ebnf(so.grammar if kind == "grammar" else so.choice, kind))
            elif kind == "structural_tag":
                _structural_tag_args(so.structural_tag)
        except ValueError as e:
            if str(e).startswith("SamplingParams."):
                raise
            raise ValueError(f"SamplingParams.structured_outputs.{kind} is invalid: {_reason(e)}") from None
        except Exception as e:  # noqa: BLE001 - xgrammar's parse errors (with the line/column or
            # position), and whatever else odd input raises: still the input's fault
            raise ValueError(f"SamplingParams.structured_outputs.{kind} does not compile: {_reason(e)}") from None

    # ---- compile (thread pool) ---------------------------------------------------------------
    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        c = self.compiler
        if key.kind == "json":
            schema = parse_schema(key.spec)
            if key.no_additional_properties:
                schema = forbid_additional_properties(schema)
            return c.compile_json_schema(json.dumps(schema), any_whitespace=key.any_whitespace)
        if key.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=key.any_whitespace)
        if key.kind == "regex":
            return c.compile_regex(key.spec)
        if key.kind == "choice":
            return c.compile_grammar(_ebnf(json.loads(key.spec), "choice"))
        if key.kind == "grammar":
            return c.compile_grammar(_ebnf(key.spec, "grammar"))
        if key.kind == "structural_tag":
            args = _structural_tag_args(key.spec)
            return c.compile_structural_tag(*args)
        raise ValueError(f"unknown structured output kind {key.kind!r}")

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarMatcher:
        return XgrammarMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids))

    # ---- bitmasks ------------------------------------------------------------------------------
    def allocate_bitmask(self, rows: int, pin: bool) -> Any:
        mask = xgr.allocate_token_bitmask(rows, self.vocab_size)  # int32 [rows, ceil(V / 32)], CPU
        return mask.pin_memory() if pin else mask

    def fill_bitmask(self, matchers: list[XgrammarMatcher], bitmask: Any) -> None:
        if len(matchers) < PARALLEL_FILL_MIN_ROWS:
            self._fill_serial(matchers, bitmask)
            return
        mode = self._fill_choice.pick()
        t = time.perf_counter()
        if mode == "threads":
            self._batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask)
        else:
            self._fill_serial(matchers, bitmask)
        self._fill_choice.record(mode, (time.perf_counter() - t) / len(matchers))

    @staticmethod
    def _fill_serial(matchers: list[XgrammarMatcher], bitmask: Any) -> None:
        for i, m in enumerate(matchers):
            m.matcher.fill_next_token_bitmask(bitmask, i)


def _ebnf(spec: str | list[str], kind: str) -> str:
    """grammar (EBNF, or Lark converted) or choice (alternatives of literal strings) as EBNF."""
    if kind == "choice":
        return "root ::= " + " | ".join(ebnf_string(c) for c in spec)
    return lark_to_ebnf(spec) if is_lark(spec) else spec


def _structural_tag_args(spec: str) -> tuple:
    """compile_structural_tag's arguments: the legacy {"structures": [...], "triggers": [...]}
    form as (tags, triggers), xgrammar's newer {"format": ...} form as the JSON text itself."""
    try:
        tag = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ValueError("must be a JSON object")
    if "structures" not in tag:
        xgr.Grammar.from_structural_tag(spec)  # checks the newer form
        return (spec,)
    try:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return items, list(tag["triggers"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"structures need begin, schema and end, and triggers a list ({e!r})") from None
