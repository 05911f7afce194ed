"""`minivllm bench spec` (W8) end to end on the CPU: the default model exported to a Hugging Face
directory (scripts/export_default_model.py, as the GPU run does), the prompts through the chat
template, every proposer's engine in its own spawned process, one JSON record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_spec_runs_each_method_in_its_own_process(tmp_path):
    model = tmp_path / "smollm2"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "export_default_model.py"), str(model),
                    "--dtype", "float32", "--num-layers", "6"], check=True, capture_output=True, timeout=300)
    assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()
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
        runs = r["batch32"]["runs_tok_per_s"]  # three timed runs, the median one reported
        assert len(runs) == 3 and runs[1] == r["batch32"]["tok_per_s"], name
    assert record["results"]["none"]["batch1"]["acceptance_rate"] is None
    assert record["results"]["layer_skip"]["batch1"]["acceptance_rate"] is not None  # drafts were verified
