"""`minivllm bench tune` on the CPU with the default model and a tiny workload: it finishes, and
the setting it chooses meets the SLO it reports when rerun."""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys

from minivllm.bench.tune import _Server, bench_args, parse_slo, slo_met
from minivllm.server.bench_serve import run_benchmark

SLO = "ttft_p99=60s,itl_p99=20s"  # lenient: the shared 2-core CI machine is slow and noisy
SERVE = "--max-model-len 256 --kv-cache-memory-bytes 33554432 --dtype float32 --device cpu --no-engine-process"
WORK = ["--num-requests", "4", "--input-len", "8", "16", "--output-len", "4", "8"]


def test_tune_finishes_and_its_choice_meets_the_slo_when_rerun(tmp_path):
    out, png = tmp_path / "tune.json", tmp_path / "tune.png"
    cmd = [sys.executable, "-m", "minivllm", "bench", "tune", "--slo", SLO, "--workload", "W3", "--rates", "2,inf",
           "--max-num-seqs", "1,4", "--max-num-batched-tokens", "256", "--serve-args", SERVE, *WORK,
           "--output", str(out), "--plot", str(png), "--log-dir", str(tmp_path / "logs")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 4 and all(row["figures"]["requests_finished"] == 4 for row in result["rows"])
    assert all(row["goodput_per_s"] is not None for row in result["rows"])
    best = result["best"]
    assert best["meets_slo"] and result["best_serve_command"].startswith("minivllm serve --max-num-seqs")
    assert "goodput/s" in r.stderr and "best:" in r.stderr  # the table and the ready command
    import matplotlib.image
    assert matplotlib.image.imread(png).shape[1] > 400
    # rerun the chosen setting at the chosen rate: it meets the SLO again
    argv = shlex.split(result["best_serve_command"])
    server = _Server(argv, str(tmp_path / "rerun.log"), 900)
    try:
        ns = bench_args(_tune_args(), server.base_url, best["request_rate"])
        figures = asyncio.run(run_benchmark(ns))["figures"]
    finally:
        server.stop()
    assert figures["requests_finished"] == 4 and slo_met(figures, parse_slo(SLO))


def _tune_args():
    import argparse
    return argparse.Namespace(slo_targets=parse_slo(SLO), num_requests=4, seed=0, input_len=[8, 16], output_len=[4, 8])
