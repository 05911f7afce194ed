"""The GPU benchmark driver: minivllm and its peers on the standard workloads, one subprocess per
job (never two engines in one process or on the GPU at once), each under a timeout, results
collected as JSON lines, and a table of ratios at the end.

    python3 -m minivllm.bench.compare --list
    python3 -m minivllm.bench.compare --only ours:W1,vllm:W1 [--out $OUT] [--budget-s 560]
    python3 -m minivllm.bench.compare --only 'ours:*' --smoke        # CPU plumbing check, tiny model
    python3 -m minivllm.bench.compare --collect DIR_OR_FILE ...       # the table from earlier runs

Jobs are named ENGINE:WORKLOAD[-VARIANT]; --only takes names and fnmatch patterns, comma-
separated ('ours:*', '*:W4*'). One device command may run at most 10 minutes, so the driver
keeps a budget (--budget-s, default 560 s): a job whose expected time no longer fits is skipped
and listed, for the next call. Output (few files, the device returns at most 8):
OUT/results.jsonl (one line per job, appended), OUT/driver.log (every child's stderr) and
OUT/summary.txt (the table). vLLM runs with PYTHONPATH=<--vllm-site>:<repo>, minivllm and HF
with PYTHONPATH=<repo>.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from minivllm.bench.common import LAUNCH_ENV

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS = ["-m", "minivllm", "bench"]
VLLM = ["-m", "minivllm.bench.peers.vllm_runner"]
HF = ["-m", "minivllm.bench.peers.hf_runner"]


@dataclass
class Job:
    name: str
    engine: str  # ours | vllm | hf
    argv: list[str]  # after `python`
    expected_s: int  # rough H100 wall time, start-up included (budget planning)
    timeout_s: int
    smoke: list[str] = field(default_factory=list)  # extra flags for --smoke (tiny model, CPU)
    produces: list[str] = field(default_factory=list)  # result names, in the order the runner prints them
    env: dict[str, str] = field(default_factory=dict)  # extra environment (e.g. VLLM_BATCH_INVARIANT=1)

    def __post_init__(self) -> None:
        self.produces = self.produces or [self.name]


_TINY_W4 = ["--model-config", "tiny-llama", "--num-requests", "4", "--max-output", "8"]  # keeps the shared prefix
_TINY = _TINY_W4 + ["--max-prompt", "64"]
_CPU = ["--device", "cpu", "--kv-cache-memory-bytes", "8000000"]
_LAT_TINY = ["--model-config", "tiny-llama", "--max-output", "8"]
_TINY_MOE = ["--model-config", "tiny-qwen3-moe", "--num-requests", "4", "--max-output", "8", "--max-prompt", "64"]
# W10: vLLM 0.20.0 needs its Triton MoE kernel on the GPU machine's image (BENCHMARKS.md)
_VLLM_MOE = ["--moe-backend", "triton"]


def _pair(name: str, ours_args: list[str], vllm_args: list[str], exp_ours: int, exp_vllm: int, smoke: list[str],
          produces: list[str] | None = None, env: dict[str, str] | None = None) -> list[Job]:
    """The same measurement on minivllm and on vLLM."""
    return [Job(f"ours:{name}", "ours", OURS + ours_args, exp_ours, 540, smoke + _CPU,
                [f"ours:{p}" for p in produces or [name]], dict(env or {})),
            Job(f"vllm:{name}", "vllm", VLLM + vllm_args, exp_vllm, 570, smoke + ["--dry-run"],
                [f"vllm:{p}" for p in produces or [name]], dict(env or {}))]


def _ours_ab(name: str, ours_args: list[str], exp_ours: int, smoke: list[str], env: dict[str, str]) -> Job:
    """minivllm alone with an environment switch: the B side of an A/B against `ours:<job>` in one lease."""
    return Job(f"ours:{name}", "ours", OURS + ours_args, exp_ours, 540, smoke + _CPU, env=env)


def _jobs() -> list[Job]:
    j: list[Job] = []
    tp = ["throughput", "--repeats", "2", "--workload"]
    j += _pair("W1", tp + ["W1"], tp + ["W1"], 120, 160, _TINY)
    j += _pair("W1-8B", tp + ["W1-8B"], tp + ["W1-8B"], 170, 220, _TINY)
    j += _pair("W4", tp + ["W4"], tp + ["W4"], 140, 190, _TINY_W4)
    # one engine (Qwen3-8B, prefix caching on) for both: saves a start-up (~100 s for vLLM)
    j += _pair("W4+W1-8B", tp + ["W4,W1-8B"], tp + ["W4,W1-8B"], 210, 250, _TINY, ["W4", "W1-8B"])
    nopc = ["throughput", "--workload", "W4", "--no-prefix-caching"]
    j += _pair("W4-nopc", nopc, nopc, 140, 190, _TINY_W4)
    j += _pair("W2", ["latency", "--model-config", "llama-3.1-8b"], ["latency", "--model-config", "llama-3.1-8b"],
               120, 170, _LAT_TINY)
    j += _pair("W2-0.6b", ["latency", "--model-config", "qwen3-0.6b"], ["latency", "--model-config", "qwen3-0.6b"],
               60, 110, _LAT_TINY)
    # batch-invariant mode (issue 22): W1 and W2 (Qwen3-0.6B batch-1 latency) with vLLM's switch,
    # which both engines honour
    bi = {"VLLM_BATCH_INVARIANT": "1"}
    j += _pair("W1-bi", tp + ["W1"], tp + ["W1"], 150, 180, _TINY, ["W1-bi"], bi)
    # the invariant GEMM's fixed launch at every row count instead of its launch table, and the
    # seeded rows' exponential race in torch ops instead of kernels/seeded_race.py: A/Bs in one lease
    j += [_ours_ab("W1-bi-notable", tp + ["W1"], 150, _TINY, dict(bi, MINIVLLM_INVARIANT_GEMM_TABLE="0"))]
    # o_proj and down_proj in 4 K slices, as lease 30's table had them (lease 31's sweep kept 1)
    j += [_ours_ab("W1-bi-split4", tp + ["W1"], 150, _TINY, dict(bi, MINIVLLM_INVARIANT_GEMM_TABLE=os.path.join(
        REPO, "docs", "perf-data", "2026-11-27", "single-gpu", "lease30-invariant-gemm-table.json")))]
    # the invariant attention tile's launch before lease 30 (BLOCK_N 64, 4 warps, 2 stages)
    j += [_ours_ab("W1-bi-oldattn", tp + ["W1"], 150, _TINY, dict(bi, MINIVLLM_INVARIANT_ATTN="64,4,2"))]
    j += [_ours_ab("W1-bi-torchrace", tp + ["W1"], 150, _TINY, dict(bi, MINIVLLM_SEEDED_RACE_KERNEL="0"))]
    j += _pair("W2-0.6b-bi", ["latency", "--model-config", "qwen3-0.6b"], ["latency", "--model-config", "qwen3-0.6b"],
               70, 120, _LAT_TINY, ["W2-0.6b-bi"], bi)
    # W10: Qwen3-30B-A3B (~61 GB of bf16 weights); one timed run each, so that both engines fit
    # one 10-minute device call (vLLM's start-up alone is minutes)
    w10 = ["throughput", "--workload", "W10"]
    j += _pair("W10", w10, w10 + _VLLM_MOE, 220, 330, _TINY_MOE)
    lat10 = ["latency", "--workload", "W10-decode"]
    lat10_tiny = ["--model-config", "tiny-qwen3-moe", "--max-output", "8"]
    j += _pair("W10-decode", lat10, lat10 + _VLLM_MOE, 180, 330, lat10_tiny)
    w2 = ["latency", "--model-config", "llama-3.1-8b"]
    # issue 21: batch-1 decode with the dense GEMV off (cuBLAS for every linear): the A/B in one lease
    nogemv = {"MINIVLLM_DENSE_GEMV": "0"}
    j += [_ours_ab("W10-decode-nogemv", lat10, 180, lat10_tiny, nogemv),
          _ours_ab("W2-nogemv", w2, 120, _LAT_TINY, nogemv)]
    # W11: Llama-3.1-8B shapes, AWQ int4 dummy packed weights (group 128), batch-1 decode; W1-8B's request
    # set with FP8 weights (quantized while loading) and an FP8 KV cache. Each engine picks its own
    # kernels (vLLM: AWQ Marlin, CUTLASS FP8)
    awq = ["latency", "--model-config", "llama-3.1-8b", "--quantization", "awq"]
    awq_tiny = _LAT_TINY + ["--quant-group-size", "32"]
    j += _pair("W11-awq", awq, awq, 130, 200, awq_tiny)
    # issue 25: the W4A16 GEMV's plain path (the packed half2 one off), and without its pipelined
    # K loop (w4a16_gemm.GEMV_PIPE), and with the default launch for every weight instead of the kept
    # per-weight table (w4a16_gemm.GEMV_TABLE), each an A/B in one lease
    j += [_ours_ab("W11-awq-plain", awq, 130, awq_tiny, {"MINIVLLM_W4A16_GEMV_HALF2": "0"}),
          _ours_ab("W11-awq-nopipe", awq, 130, awq_tiny, {"MINIVLLM_W4A16_GEMV_PIPE": "0"}),
          _ours_ab("W11-awq-notable", awq, 130, awq_tiny, {"MINIVLLM_W4A16_GEMV_TABLE": "0"}),
          # the activation pairs formed in registers instead of loaded as words (w4a16_gemm.GEMV_XPAIR)
          _ours_ab("W11-awq-noxpair", awq, 130, awq_tiny, {"MINIVLLM_W4A16_GEMV_XPAIR": "0"}),
          _ours_ab("W11-awq-nodense", awq, 130, awq_tiny, {"MINIVLLM_W4A16_DENSE_CHOICE": "0"}),
          # the GEMV's scales and zeros as two tiles, not one word per pair (w4a16_gemm.GEMV_SZ_PAIRS)
          _ours_ab("W11-awq-nopairs", awq, 130, awq_tiny, {"MINIVLLM_W4A16_GEMV_SZ_PAIRS": "0"})]
    # the rotary and the K/V store as two launches instead of one (store_kv.rotary_store_kv)
    norotstore = {"MINIVLLM_ROTARY_STORE_KV": "0"}
    j += [_ours_ab("W11-awq-norotstore", awq, 130, awq_tiny, norotstore),
          _ours_ab("W2-norotstore", w2, 120, _LAT_TINY, norotstore)]
    # decode attention's chunks merged by a second kernel instead of the last split program
    mergekernel = {"MINIVLLM_DECODE_MERGE": "kernel"}
    j += [_ours_ab("W11-awq-mergekernel", awq, 130, awq_tiny, mergekernel),
          _ours_ab("W2-mergekernel", w2, 120, _LAT_TINY, mergekernel)]
    # programmatic dependent launch off (kernels/pdl.py; on by default on Hopper): the A/B in one lease
    nopdl = {"MINIVLLM_PDL": "0"}
    j += [_ours_ab("W10-decode-nopdl", lat10, 180, lat10_tiny, nopdl),
          _ours_ab("W11-awq-nopdl", awq, 130, awq_tiny, nopdl),
          _ours_ab("W2-nopdl", w2, 120, _LAT_TINY, nopdl),
          _ours_ab("W1-nopdl", tp + ["W1"], 120, _TINY, nopdl)]
    # issue 21: the one-token MoE GEMVs instead of the streaming kernels (fused_moe.DECODE_STREAM), and
    # the dense one-row GEMVs on the split-K kernel instead of the streaming one (dense_gemv.STREAM)
    j += [_ours_ab("W10-decode-nostream", lat10, 180, lat10_tiny, {"MINIVLLM_MOE_DECODE_STREAM": "0"}),
          _ours_ab("W10-decode-nodstream", lat10, 180, lat10_tiny, {"MINIVLLM_DENSE_GEMV_STREAM": "0"}),
          _ours_ab("W2-nodstream", w2, 120, _LAT_TINY, {"MINIVLLM_DENSE_GEMV_STREAM": "0"})]
    fp8 = tp + ["W1-8B", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    j += _pair("W11-fp8", fp8, fp8, 180, 260, _TINY)
    # issue 23: W1 with 4 dummy rank-16 LoRA adapters spread over the requests (vs W1 without), and
    # beam search of width 4 on W1's prompts (128 tokens each, ignore_eos)
    lora = tp + ["W1", "--num-loras", "4", "--lora-rank", "16"]
    j += _pair("W1-lora4", lora, lora, 150, 200, _TINY + ["--num-loras", "2", "--lora-rank", "4"])
    beam = tp + ["W1", "--beam-width", "4", "--beam-max-tokens", "128"]
    j += _pair("W1-beam4", beam, beam, 200, 260, _TINY + ["--beam-width", "2", "--beam-max-tokens", "8"],
               ["W1-beam4"])
    j += _w9_jobs(tp)
    j.append(Job("hf:W1", "hf", HF + ["throughput", "--workload", "W1"], 330, 570,
                 _TINY + ["--device", "cpu", "--batch-size", "2"]))
    j.append(Job("hf:decode-0.6b", "hf", HF + ["decode", "--model-config", "qwen3-0.6b"], 90, 300,
                 ["--model-config", "tiny-llama", "--max-output", "8", "--device", "cpu"]))
    # dedicated W6 runs (W1 and W2 runs already report launch_to_first_token_s in passing)
    for variant, cfg, exp_ours, exp_vllm in (("-0.6b", "qwen3-0.6b", 60, 110), ("-llama8b", "llama-3.1-8b", 100, 170)):
        j.append(Job(f"ours:W6{variant}", "ours", OURS + ["startup", "--model-config", cfg], exp_ours, 400,
                     ["--model-config", "tiny-llama", "--device", "cpu"]))
        j.append(Job(f"vllm:W6{variant}", "vllm", VLLM + ["startup", "--model-config", cfg], exp_vllm, 400, []))
    return j


def _w9_jobs(tp: list[str]) -> list[Job]:
    """W9 (issue 27): several GPUs. Run each job with CUDA_VISIBLE_DEVICES naming its GPUs
    (scripts/gpu_multi.sh gives each lane its own); the smoke form runs the same layout on the
    CPU with gloo. vLLM's offline LLM has no data_parallel_size: dp runs go through the server."""
    j: list[Job] = []
    mp = ["--distributed-executor-backend", "mp"]

    def par(flags: list[str]) -> list[str]:
        return flags + (mp if flags and "-dp" not in flags else [])

    for name, base, flags, e_ours, e_vllm in (
            ("W1-8B-tp2", tp + ["W1-8B"], ["-tp", "2"], 150, 240),
            ("W1-8B-tp4", tp + ["W1-8B"], ["-tp", "4"], 150, 260),
            ("W2-tp2", ["latency", "--model-config", "llama-3.1-8b"], ["-tp", "2"], 130, 220),
            ("W1-32B-tp2", _32B, ["-tp", "2"], 200, 330),
            ("W1-32B-tp4", _32B, ["-tp", "4"], 170, 300),
            ("W1-32B-pp2", _32B, ["-pp", "2"], 220, 330),
            ("W1-32B-tp2pp2", _32B, ["-tp", "2", "-pp", "2"], 200, 330),
            ("W10-tp2", ["throughput", "--workload", "W10"], ["-tp", "2"], 200, 330),
            ("W10-tp2-ep", ["throughput", "--workload", "W10"], ["-tp", "2", "--enable-expert-parallel"], 200, 330),
            ("W10-decode-tp2", ["latency", "--workload", "W10-decode"], ["-tp", "2"], 180, 330),
            ("W10-decode-tp2-ep", ["latency", "--workload", "W10-decode"], ["-tp", "2", "--enable-expert-parallel"],
             180, 330)):
        moe = _VLLM_MOE if "W10" in name else []
        smoke = (_TINY_MOE if "W10" in name else _LAT_TINY if "latency" in base else _TINY) + par(flags)
        j += _pair(name, base + par(flags), base + flags + moe, e_ours, e_vllm, smoke)
    # the custom all-reduce's A/B (distributed/symm_all_reduce.py): the same runs with NCCL alone
    nccl = {"MINIVLLM_CUSTOM_ALL_REDUCE": "0"}
    j += [_ours_ab("W1-8B-tp2-nccl", tp + ["W1-8B", "-tp", "2"] + mp, 150, _TINY + ["-tp", "2"] + mp, nccl),
          _ours_ab("W2-tp2-nccl", ["latency", "--model-config", "llama-3.1-8b", "-tp", "2"] + mp, 130,
                   _LAT_TINY + ["-tp", "2"] + mp, nccl),
          _ours_ab("W1-8B-tp4-nccl", tp + ["W1-8B", "-tp", "4"] + mp, 150, _TINY + ["-tp", "4"] + mp, nccl)]
    # the distributed code path's cost on one GPU: W1 with its one rank in a worker process (issue 20)
    j.append(Job("ours:W1-8B-mp", "ours", OURS + tp + ["W1-8B", "--distributed-executor-backend", "mp"], 150, 540,
                 _TINY + _CPU + ["--distributed-executor-backend", "mp"]))
    j.append(Job("ours:W1-mp", "ours", OURS + tp + ["W1", "--distributed-executor-backend", "mp"], 130, 540,
                 _TINY + _CPU + ["--distributed-executor-backend", "mp"]))
    # data parallel + expert parallel: attention per replica, experts over both (minivllm only offline)
    dp_ep = ["throughput", "--workload", "W10", "-dp", "2", "--enable-expert-parallel"]
    j.append(Job("ours:W10-dp2-ep", "ours", OURS + dp_ep, 220, 540, _TINY_MOE + _CPU))
    return j


_32B = ["throughput", "--repeats", "1", "--workload", "W1", "--model-config", "qwen3-32b"]


JOBS = {job.name: job for job in _jobs()}
# BENCHMARKS.md's comparison set; longer than one 10-minute device command: split it with --only
DEFAULT_ORDER = ["ours:W1", "vllm:W1", "ours:W2", "vllm:W2", "ours:W4+W1-8B", "vllm:W4+W1-8B", "ours:W4-nopc",
                 "vllm:W4-nopc", "hf:W1"]


def select(only: str | None) -> list[Job]:
    if not only:
        return [JOBS[n] for n in DEFAULT_ORDER]
    out: list[Job] = []
    for pat in (p.strip() for p in only.split(",") if p.strip()):
        hits = [j for n, j in JOBS.items() if fnmatch.fnmatchcase(n, pat)]
        if not hits:
            raise SystemExit(f"--only: no job matches {pat!r}; jobs: {', '.join(JOBS)}")
        out += [h for h in hits if h not in out]
    return out


# ---- running ---------------------------------------------------------------------------------------------
def job_env(job: Job, vllm_site: str) -> dict:
    env = dict(os.environ)
    paths = [REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if job.engine == "vllm":
        paths.insert(0, vllm_site)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(job.env)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_job(job: Job, args, timeout: float, tmpdir: str, log_f) -> dict:
    out_json = os.path.join(tmpdir, job.name.replace(":", "_") + ".json")
    argv = list(job.argv) + (job.smoke if args.smoke else []) + ["--output", out_json]
    cmd = [args.python] + argv
    rec = {"job": job.name, "engine": job.engine, "command": " ".join(cmd), "started": time.strftime("%H:%M:%S")}
    if job.engine == "vllm" and not args.smoke and not os.path.isdir(args.vllm_site):
        return dict(rec, rc=None, error=f"skipped: no vLLM at {args.vllm_site} (see scripts/vllm_carry.md)")
    if args.smoke and job.engine == "vllm" and "--dry-run" not in job.smoke:
        return dict(rec, rc=None, error="skipped: no smoke form (needs vLLM)")
    log_f.write(f"\n===== {job.name}: {rec['command']}\n")
    log_f.flush()
    t = time.perf_counter()
    env = job_env(job, args.vllm_site)
    env[LAUNCH_ENV] = repr(time.time())  # W6: the runner reports launch -> first token
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log_f, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        stdout, _ = proc.communicate()
        rc = "timeout"
    _kill_group(proc.pid)  # leftovers of the job (vLLM's engine-core process) must not hold the GPU
    rec.update(rc=rc, elapsed_s=round(time.perf_counter() - t, 1))
    result = None
    if os.path.isfile(out_json):
        with open(out_json) as f:
            result = json.load(f)
    else:
        try:
            from minivllm.bench.common import last_json_line
            result = last_json_line(stdout or "")
        except ValueError:
            pass
    rec["result"] = result
    if rc != 0 or result is None:
        rec["error"] = f"rc={rc}; see driver.log"
    return rec


def split_record(job: Job, rec: dict) -> list[dict]:
    """One record per result name the job produces (a runner may print several workloads)."""
    result = rec.get("result")
    results = result if isinstance(result, list) else [result]
    out = []
    for i, name in enumerate(job.produces):
        r = results[i] if i < len(results) else None
        err = rec.get("error") or (None if r is not None else "no result for this workload")
        out.append(dict(rec, job=name, from_job=job.name, result=r, error=err))
    return out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


# ---- the table ---------------------------------------------------------------------------------------------
# (row label, result-name suffixes tried in order, figure key, lower is better)
ROWS = [
    ("W1 output tok/s", ["W1"], "output_tok_per_s", False),
    ("W1 output tok/s, best of the repeats", ["W1"], "best_output_tok_per_s", False),
    ("W1 LLM() startup s", ["W1"], "startup_s", True),
    ("W1-8B output tok/s", ["W1-8B"], "output_tok_per_s", False),
    ("W1-8B output tok/s, best of the repeats", ["W1-8B"], "best_output_tok_per_s", False),
    ("W2 decode tok/s", ["W2"], "decode_tok_per_s", False),
    ("W2 ms per token", ["W2"], "ms_per_token", True),
    ("W2 TTFT s", ["W2"], "ttft_s", True),
    ("W2 roofline share", ["W2"], "roofline_share", False),
    ("W2 roofline share (all weights)", ["W2"], "roofline_share_all_weights", False),
    ("batch-1 decode tok/s, Qwen3-0.6B", ["W2-0.6b"], "decode_tok_per_s", False),
    ("W1 output tok/s, batch-invariant mode", ["W1-bi"], "output_tok_per_s", False),
    ("batch-1 decode tok/s, Qwen3-0.6B, batch-invariant mode", ["W2-0.6b-bi"], "decode_tok_per_s", False),
    ("W4 output tok/s, prefix caching on", ["W4"], "output_tok_per_s", False),
    ("W4 mean TTFT s, prefix caching on", ["W4"], "mean_ttft_s", True),
    ("W4 prefix hit rate (cached / prompt tokens)", ["W4"], "prefix_hit_rate_cached_tokens", False),
    ("W4 output tok/s, prefix caching off", ["W4-nopc"], "output_tok_per_s", False),
    ("W4 mean TTFT s, prefix caching off", ["W4-nopc"], "mean_ttft_s", True),
    ("W10 output tok/s (Qwen3-30B-A3B)", ["W10"], "output_tok_per_s", False),
    ("W10 output tok/s, best of the repeats", ["W10"], "best_output_tok_per_s", False),
    ("W10 LLM() startup s", ["W10"], "startup_s", True),
    ("W10 batch-1 decode tok/s", ["W10-decode"], "decode_tok_per_s", False),
    ("W10 batch-1 ms per token", ["W10-decode"], "ms_per_token", True),
    ("W10 batch-1 roofline share (active weights)", ["W10-decode"], "roofline_share", False),
    ("W11 AWQ int4 batch-1 decode tok/s, Llama-3.1-8B", ["W11-awq"], "decode_tok_per_s", False),
    ("W11 AWQ int4 roofline share (int4 weight bytes)", ["W11-awq"], "roofline_share", False),
    ("W11 W1-8B output tok/s, FP8 weights + FP8 KV", ["W11-fp8"], "output_tok_per_s", False),
    ("W6 launch to first token s, Qwen3-0.6B", ["W6-0.6b", "W1"], "launch_to_first_token_s", True),
    ("W6 launch to first token s, Llama-3.1-8B", ["W6-llama8b", "W2"], "launch_to_first_token_s", True),
]
HF_ROWS = {("W1", "output_tok_per_s"): "hf:W1", ("W2-0.6b", "decode_tok_per_s"): "hf:decode-0.6b"}


def _first(results: dict, engine: str, suffixes: list[str], key: str):
    for suf in suffixes:
        v = _fig(results, f"{engine}:{suf}", key)
        if v is not None:
            return v, suf
    return None, None


def _fig(results: dict, job: str, key: str):
    rec = results.get(job)
    if not rec or not rec.get("result"):
        return None
    return (rec["result"].get("figures") or {}).get(key)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def table(results: dict) -> str:
    lines = [f"{'metric':<60} {'minivllm':>10} {'vLLM':>10} {'ours/vLLM':>10} {'HF':>10} {'ours/HF':>8}"]
    for label, suffixes, key, lower in ROWS:
        ours, suffix = _first(results, "ours", suffixes, key)
        vllm, _ = _first(results, "vllm", suffixes, key)
        hf_job = HF_ROWS.get((suffix or suffixes[0], key))
        hf = _fig(results, hf_job, key) if hf_job else None
        if ours is None and vllm is None and hf is None:
            continue
        r_v = ours / vllm if ours is not None and vllm else None
        r_h = ours / hf if ours is not None and hf else None
        lines.append(f"{label + (' (lower=better)' if lower else ''):<60} {_fmt(ours):>10} {_fmt(vllm):>10} "
                     f"{_fmt(r_v):>10} {_fmt(hf):>10} {_fmt(r_h):>8}")
    bad = [f"{n}: {r.get('error')}" for n, r in results.items() if r.get("error")]
    if bad:
        lines.append("not measured / failed:")
        lines += [f"  {b}" for b in bad]
    devices = sorted({r["result"].get("device") for r in results.values() if r.get("result")} - {None})
    lines.append(f"devices: {', '.join(devices) or '-'}")
    return "\n".join(lines)


def load_results(paths: list[str]) -> dict:
    """The latest record of each job from results.jsonl files (or directories holding them)."""
    recs: dict = {}
    for p in paths:
        files = [os.path.join(p, "results.jsonl")] if os.path.isdir(p) else [p]
        for fpath in files:
            if not os.path.isfile(fpath):
                continue
            with open(fpath) as f:
                for line in f:
                    if line.strip():
                        rec = json.loads(line)
                        if rec.get("result") or rec["job"] not in recs:
                            recs[rec["job"]] = rec
    return recs


# ---- main --------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="comma-separated job names or patterns (default: the main set)")
    p.add_argument("--list", action="store_true", help="list the jobs and exit")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/minivllm-bench")
    p.add_argument("--budget-s", type=float, default=560, help="wall budget of this call; 0 = none")
    p.add_argument("--vllm-site", default="/tmp/vllm-site", help="where install.sh put vLLM")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU; vLLM jobs as --dry-run")
    p.add_argument("--collect", nargs="*", default=None, help="print the table from these results, run nothing")
    args = p.parse_args(argv)
    if args.list:
        for j in JOBS.values():
            print(f"{j.name:<18} ~{j.expected_s:>4} s  timeout {j.timeout_s:>4} s  python {' '.join(j.argv)}")
        return 0
    if args.collect is not None:
        print(table(load_results(args.collect or [args.out])))
        return 0
    return run_all(args, select(args.only))


def run_all(args, jobs: list[Job]) -> int:
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "driver.log")
    t0 = time.perf_counter()
    results: dict = {}
    failed = False
    with tempfile.TemporaryDirectory(prefix="minivllm-bench-") as tmpdir, open(log_path, "a") as log_f:
        for job in jobs:
            left = args.budget_s - (time.perf_counter() - t0) if args.budget_s else float("inf")
            if not args.smoke and job.expected_s > left:
                rec = {"job": job.name, "engine": job.engine, "rc": None,
                       "error": f"skipped: expected ~{job.expected_s} s, {left:.0f} s of the budget left"}
            else:
                print(f"[compare] {job.name} ... (timeout {min(job.timeout_s, left):.0f} s)", flush=True)
                rec = run_job(job, args, min(job.timeout_s, left), tmpdir, log_f)
            with open(os.path.join(args.out, "results.jsonl"), "a") as f:
                for r in split_record(job, rec):
                    results[r["job"]] = r
                    f.write(json.dumps(r, default=str) + "\n")
            status = "ok" if not rec.get("error") else rec["error"]
            print(f"[compare] {job.name}: {status} ({rec.get('elapsed_s', 0)} s)", flush=True)
            if rec.get("error") and not str(rec["error"]).startswith("skipped"):
                failed = True
                log_f.flush()
                print(_tail(log_path), flush=True)
    summary = table(results)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(summary + "\n")
    print(summary, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
