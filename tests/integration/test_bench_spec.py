"""`minivllm bench spec` (W8) end to end on the CPU: the default model exported to a Hugging Face
directory (scripts/export_default_model.py, as the GPU run does), the prompts through the chat
template, every proposer's engine in its own spawned process, one JSON record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model = tmp_path_factory.mktemp("w8") / "smollm2"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "export_default_model.py"), str(model),
                    "--dtype", "float32", "--num-layers", "6"], check=True, capture_output=True, timeout=300)
    assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()
    return model


def test_bench_spec_runs_each_method_in_its_own_process(model, tmp_path):
    out = tmp_path / "w8.json"
    subprocess.run([sys.executable, "-m", "minivllm", "bench", "spec", "--model", str(model), "--methods",
                    "none,ngram,layer_skip", "--layer-skip-layers", "3", "--num-prompts", "3", "--batch1-prompts", "1",
                    "--max-tokens", "6", "--repeats", "3", "--dtype", "float32", "--warm-each-phase",
                    "--output", str(out)],
                   check=True, capture_output=True, timeout=600, cwd=ROOT)
    record = json.loads(out.read_text())
    assert set(record["results"]) == {"none", "ngram", "layer_skip"}
    for name, r in record["results"].items():  # (--warm-each-phase's untimed runs are not counted)
        assert r["batch1"]["output_tokens"] == 6 and r["batch32"]["output_tokens"] == 3 * 6, name
        runs = r["batch32"]["runs_tok_per_s"]  # three timed runs in run order, the median one reported
        assert len(runs) == 3 and sorted(runs)[1] == r["batch32"]["tok_per_s"], name
    assert record["results"]["none"]["batch1"]["acceptance_rate"] is None
    assert record["results"]["layer_skip"]["batch1"]["acceptance_rate"] is not None  # drafts were verified


def test_bench_spec_interleaved_takes_the_engines_runs_in_turn(model, tmp_path):
    """--interleave: both engines in one process, each phase's timed runs taken in turn; every
    run is counted for its own engine, and the paired ratios are those of same-round runs."""
    out = tmp_path / "w8.json"
    subprocess.run([sys.executable, "-m", "minivllm", "bench", "spec", "--model", str(model), "--methods", "none,ngram",
                    "--num-prompts", "3", "--batch1-prompts", "1", "--max-tokens", "6", "--repeats", "3",
                    "--dtype", "float32", "--interleave", "--kv-cache-memory-bytes", str(64 << 20),
                    "--output", str(out)],
                   check=True, capture_output=True, timeout=600, cwd=ROOT)
    record = json.loads(out.read_text())
    assert record["interleaved"] and set(record["results"]) == {"none", "ngram"}
    none, ngram = record["results"]["none"], record["results"]["ngram"]
    for r in (none, ngram):
        assert r["batch1"]["output_tokens"] == 6 and r["batch32"]["output_tokens"] == 3 * 6
        assert len(r["batch32"]["runs_tok_per_s"]) == 3 and len(r["batch1"]["runs_tok_per_s"]) == 3
    assert none["paired_ratio_to_none"]["batch32"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    ratios = [a / b for a, b in zip(ngram["batch32"]["runs_tok_per_s"], none["batch32"]["runs_tok_per_s"])]
    paired = ngram["paired_ratio_to_none"]["batch32"]
    assert paired["min"] == pytest.approx(min(ratios), rel=1e-3) and paired["max"] == pytest.approx(max(ratios), rel=1e-3)
    assert none["batch1"]["acceptance_rate"] is None and none["batch32"]["acceptance_rate"] is None  # never drafts
