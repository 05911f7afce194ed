"""Profiling with worker processes (engine/profiler.py): with the mp executor running two ranks
(tp=2, gloo on the CPU) a trace is written for the engine AND for rank 0 and rank 1, through the
engine core's profile command (what /start_profile and /stop_profile send), through a server
with --profile-dir, and through `minivllm bench ... --profile`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from minivllm import LLM, SamplingParams
from minivllm.engine.profiler import apply_profile_command
from minivllm.server.testing import wait_until


def _until(pred, timeout_s: float = 120.0, what: str = "condition"):
    return wait_until(pred, timeout_s, what, poll_s=0.1)


def _names(trace: Path) -> set[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    assert events, f"{trace.name} holds no events"
    return {str(e.get("name", "")) for e in events}


def _one(directory: Path, pattern: str) -> Path:
    (path,) = _until(lambda: list(directory.glob(pattern)), what=f"a file {pattern} in {directory}")
    return path


def _check_rank_traces(directory: Path, prefix: str) -> None:
    """prefix-rank0-* and prefix-rank1-* exist, load as JSON and hold the model's ops."""
    for rank in (0, 1):
        names = _names(_one(directory, f"{prefix}-rank{rank}-*.pt.trace.json"))
        assert any(n.startswith("aten::") for n in names), f"rank {rank}'s trace has no model ops"
    assert not list(directory.glob(f"{prefix}-rank2-*"))  # two ranks, two rank traces


def test_profile_command_traces_the_engine_and_every_rank(tiny_llama, tmp_path):
    llm = LLM(model=tiny_llama(), dtype="float32", device="cpu", skip_tokenizer_init=True, num_kv_blocks=32,
              tensor_parallel_size=2, distributed_executor_backend="mp")
    engine = llm.llm_engine
    try:
        apply_profile_command(engine, "start", None)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [1, 5, 9, 33]}, {"prompt_token_ids": [7] * 20}], params, use_tqdm=False)
        apply_profile_command(engine, "stop", str(tmp_path))
        names = _names(_one(tmp_path, "engine-2*.pt.trace.json"))  # the engine's own (a date follows)
        assert {"minivllm.schedule", "minivllm.launch"} <= names
        _check_rank_traces(tmp_path, "engine")
        assert len(engine.profiler.rank_trace_paths) == 2
        apply_profile_command(engine, "stop", str(tmp_path))  # no trace running: logged, nothing raised
        llm.generate([{"prompt_token_ids": [3, 4]}], params, use_tqdm=False)  # the ranks still serve
    finally:
        engine.shutdown()


def test_server_start_and_stop_profile_write_every_ranks_trace(tiny_llama, tmp_path):
    from minivllm.engine.mp_async_engine import MPAsyncEngine
    from minivllm.server.app import create_app
    from minivllm.server.serving_common import ServerSettings
    from minivllm.server.testing import ServerThread
    engine = MPAsyncEngine.from_kwargs(model=tiny_llama(), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                       num_kv_blocks=32, tensor_parallel_size=2, distributed_executor_backend="mp")
    settings = ServerSettings(profile_dir=str(tmp_path), status_log_interval_s=None)
    with ServerThread(create_app(engine, settings)) as srv:
        assert httpx.post(srv.base_url + "/start_profile").status_code == 200
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": [5] * 12, "max_tokens": 4,
                                                               "detokenize": False}, timeout=120)
        assert r.status_code == 200, r.text
        assert httpx.post(srv.base_url + "/stop_profile").status_code == 200
        assert "minivllm.launch" in _names(_one(tmp_path, "engine-2*.pt.trace.json"))
        _check_rank_traces(tmp_path, "engine")


def test_bench_profile_writes_a_trace_per_rank(tmp_path):
    trace_dir = tmp_path / "traces"
    cmd = [sys.executable, "-m", "minivllm", "bench", "throughput", "--workload", "W1", "--model-config",
           "tiny-llama", "--device", "cpu", "--num-requests", "4", "--max-output", "8", "--max-prompt", "32",
           "--distributed-executor-backend", "mp", "-tp", "2", "--profile", "--profile-dir", str(trace_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert any(n.startswith("minivllm.") for n in _names(_one(trace_dir, "bench-2*.pt.trace.json")))
    _check_rank_traces(trace_dir, "bench")
