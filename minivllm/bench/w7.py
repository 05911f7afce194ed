"""Workload W7 (structured output) as plain data, for minivllm and vLLM alike (pure Python: no
torch, no engine import).

BENCHMARKS.md: Qwen3-8B shapes, dummy bf16 weights, a real tokenizer, W1's request set (256
requests, same seed), request i constrained by schema i mod 8 of `bench/schemas/`, max_tokens
512, temperature 0.6. The Qwen3 tokenizer is not available to the GPU machine (only config.json
is in ../shared/model-configs/qwen3-8b), so the model directory carries the default model's
(SmolLM2's 49,152-token vocabulary, exported to `bench/tokenizers/smollm2/`) and the config's
vocab_size becomes 49,152 (a multiple of 64, equal to the tokenizer's: no padding to mask), with
its eos/bos ids. W1's prompt ids (< 10,000) are valid in that vocabulary.

`config_tree.json` marks its tags `uniqueItems`, which no grammar can enforce (minivllm refuses
it with a 400, vLLM's xgrammar backend too): W7 drops that keyword, for both engines.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from minivllm.bench import model_dirs, workloads

HERE = Path(__file__).resolve().parent
SCHEMAS_DIR = HERE / "schemas"
W7_MAX_TOKENS = 512
W7_TEMPERATURE = 0.6


def load_schemas() -> list[tuple[str, str, dict]]:
    """[(name, prompt, schema)] in file-name order (schema i of request i mod 8)."""
    out = []
    for path in sorted(SCHEMAS_DIR.glob("*.json")):
        d = json.loads(path.read_text())
        out.append((path.stem, d["prompt"], strip_unenforceable(d["schema"])))
    return out


def strip_unenforceable(schema: dict) -> dict:
    """The schema without `uniqueItems` (see the module docstring)."""
    if isinstance(schema, dict):
        return {k: strip_unenforceable(v) for k, v in schema.items() if k != "uniqueItems"}
    if isinstance(schema, list):
        return [strip_unenforceable(v) for v in schema]
    return schema


def w7_requests() -> tuple[list[list[int]], list[dict], list[str]]:
    """(prompts, constrained param dicts, schema name per request). A param dict carries
    "json_schema": the runners turn it into their engine's structured-output params."""
    w1 = workloads.get("W1")
    schemas = load_schemas()
    params, names = [], []
    for i in range(len(w1.prompts)):
        name, _, schema = schemas[i % len(schemas)]
        params.append({"temperature": W7_TEMPERATURE, "max_tokens": W7_MAX_TOKENS, "seed": i, "json_schema": schema})
        names.append(name)
    return [list(p) for p in w1.prompts], params, names


def unconstrained_twins(params: list[dict], num_tokens: list[int]) -> list[dict]:
    """The same requests without the constraint, each producing exactly as many tokens as its
    constrained run did (ignore_eos): the same schedule, so the per-token cost compares."""
    return [{"temperature": p["temperature"], "max_tokens": max(1, n), "seed": p["seed"], "ignore_eos": True}
            for p, n in zip(params, num_tokens)]


def write_model_dir(dest: str | None = None, base: str = "qwen3-8b") -> str:
    """Qwen3-8B's config.json (or `base`'s, for smoke tests) with the SmolLM2 vocabulary and
    tokenizer files, in dest or a new temporary directory."""
    d = model_dirs.write_model_dir(base, dest)
    model_dirs.add_bundled_tokenizer(d)
    return d


def ttft_schemas() -> list[tuple[str, dict]]:
    """The 8 schemas, for the TTFT probe: each is first seen (cold) then repeated (warm)."""
    return [(name, schema) for name, _, schema in load_schemas()]


def validates(text: str, schema: dict) -> bool:
    """Whether text is JSON that the `jsonschema` package validates against schema."""
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
