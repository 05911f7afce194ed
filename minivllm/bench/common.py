"""What every benchmark runner shares: the JSON envelope, device facts, the copy-bandwidth probe
and the command-line options common to minivllm's and the peers' runners.

Every runner prints one JSON object per workload it ran, one per line, last on stdout (logs go
to stderr; `--output FILE` also writes it, a list when several workloads shared one engine):

    {"workload": "W1", "engine": "minivllm" | "vllm" | "hf", "engine_version": ..,
     "model_config": "qwen3-0.6b", "device": "NVIDIA H100 80GB HBM3", "date": ..,
     "command": "python -m minivllm bench throughput --workload W1", "settings": {..},
     "workload_summary": {..}, "figures": {..}, "details": {..}}

Importing this module does not import torch (the vLLM runner imports it before vLLM).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def command_line() -> str:
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return shlex.join(argv)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def device_name(device: str = "auto") -> str:
    """The GPU's name when the run uses CUDA, else the CPU's."""
    if device == "cpu":
        return cpu_name()
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return cpu_name()


def git_revision() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        r = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        if r.returncode == 0:
            dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return r.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("MINIVLLM_GIT_REV")


def versions() -> dict:
    out = {"python": sys.version.split()[0], "minivllm_git": git_revision()}
    try:
        import torch
        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    return out


def envelope(workload: str, engine: str, engine_version: str | None, model_config: str, device: str,
             settings: dict, workload_summary: dict | None, figures: dict, details: dict | None = None) -> dict:
    return {"workload": workload, "engine": engine, "engine_version": engine_version, "model_config": model_config,
            "device": device, "date": now_iso(), "command": command_line(), "versions": versions(),
            "settings": settings, "workload_summary": workload_summary, "figures": figures, "details": details or {}}


def emit(result: dict, output: str | None = None) -> None:
    """Prints the result as one JSON line (the runner's last stdout line) and writes it to output."""
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(result, f, indent=1, default=str)
    sys.stdout.write(json.dumps(result, default=str) + "\n")
    sys.stdout.flush()


def param_bytes(model) -> int:
    """Bytes of the model's parameters, each counted once (`parameters()` yields a tied
    embedding / lm_head weight once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


LAUNCH_ENV = "MINIVLLM_BENCH_LAUNCH_TIME"


def launch_time() -> tuple[float | None, str]:
    """When this process was launched (time.time() scale): the parent's stamp in
    MINIVLLM_BENCH_LAUNCH_TIME (set just before it starts us), else the kernel's record of the
    process start (/proc/self/stat starttime + /proc/stat btime, 10 ms resolution)."""
    v = os.environ.get(LAUNCH_ENV)
    if v:
        try:
            return float(v), "parent stamp (" + LAUNCH_ENV + ")"
        except ValueError:
            pass
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK"), "/proc/self/stat starttime"
    except (OSError, ValueError, IndexError, StopIteration):
        return None, "unknown"


def emit_all(results: list[dict], output: str | None = None) -> None:
    """Several results of one process (several workloads on one engine): one JSON line each;
    the output file holds the object, or a list of them."""
    if len(results) == 1:
        emit(results[0], output)
        return
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(results, f, indent=1, default=str)
    for r in results:
        emit(r)


# ---- copy bandwidth ------------------------------------------------------------------------------
def measure_copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20, warmup: int = 3) -> dict:
    """Device-to-device copy of nbytes; bandwidth counts bytes read + written (2 x nbytes)."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    t = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes_copied": nbytes, "bytes_read_plus_written": 2 * nbytes, "median_s": t,
            "bandwidth_Bps": 2 * nbytes / t, "bandwidth_TBps": 2 * nbytes / t / 1e12, "iters": iters,
            "device": torch.cuda.get_device_name(0)}


def copy_bandwidth_in_subprocess(timeout: float = 120) -> dict:
    """Runs the probe in a child process so this process's CUDA context and memory stay untouched
    (the engine under test sizes its KV cache from free memory)."""
    r = subprocess.run([sys.executable, "-m", "minivllm.bench.common", "bandwidth"], capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"copy bandwidth probe failed: {r.stderr[-2000:]}")
    return last_json_line(r.stdout)


def last_json_line(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError("no JSON object line in the output")


# ---- options shared by minivllm's and the peers' runners -----------------------------------------
def workload_list(allowed: list[str]):
    """An argparse type: one workload, or several comma-separated (run on one engine, in order)."""
    def parse(value: str) -> list[str]:
        names = [v.strip() for v in value.split(",") if v.strip()]
        bad = [n for n in names if n not in allowed]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"workload must be one or more of {', '.join(allowed)} "
                                             f"(comma-separated), got {value!r}")
        return names
    return parse


def add_workload_args(p: argparse.ArgumentParser, workloads: list[str], default: str) -> None:
    p.add_argument("--workload", default=[default], type=workload_list(workloads),
                   help=f"{' | '.join(workloads)}; several, comma-separated, run one after the other on one "
                        "engine (they must share the model config)")
    p.add_argument("--model-config", default=None,
                   help="bundled config name (qwen3-0.6b, qwen3-8b, qwen3-32b, llama-3.1-8b, tiny-llama), a "
                        "directory holding config.json, or a config.json; default: the workload's model")
    p.add_argument("--num-requests", type=int, default=None, help="smoke runs: the first N requests of the draw")
    p.add_argument("--max-output", type=int, default=None, help="smoke runs: clamp every max_tokens to this")
    p.add_argument("--max-prompt", type=int, default=None, help="smoke runs: cut every prompt to this many tokens")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the workload's (4096)")
    p.add_argument("--output", default=None, help="also write the JSON result to this file")


def add_common_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-prefix-caching turns it off")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="same as --no-enable-prefix-caching")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default=None, choices=["awq", "fp8"],
                   help="W11: awq = the model directory's config gets an AWQ int4 quantization_config (dummy "
                        "packed weights, float16); fp8 = quantization='fp8' (weights quantized while loading)")
    p.add_argument("--quant-group-size", type=int, default=128, help="AWQ group size (smoke runs on tiny configs: 32)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                   help="issue 20: mp runs the one rank in a worker process (the distributed code path)")
    # issue 20/27 (W9): the same names as vLLM's LLM(...) and `serve`
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="minivllm only offline (vLLM's LLM runs one replica per process): W3 compares dp through serve")
    p.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="MoE experts spread over the tp (x dp) ranks")
    p.add_argument("--disable-custom-all-reduce", action="store_true", default=None,
                   help="NCCL for every TP all-reduce (both engines' option)")
    p.add_argument("--kv-offloading-size", type=float, default=None,
                   help="W12: GiB of host memory for the prefix cache's CPU offload tier (both engines' option)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs; the figure is the first, later ones follow reset_prefix_cache()")


def _main(argv: list[str]) -> int:
    if argv[:1] == ["bandwidth"]:
        emit(measure_copy_bandwidth())
        return 0
    print("usage: python -m minivllm.bench.common bandwidth", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


def quant_dir_config(args: argparse.Namespace) -> dict | None:
    """The quantization_config to write into the benchmark's model directory (--quantization awq)."""
    if getattr(args, "quantization", None) != "awq":
        return None
    from minivllm.bench.model_dirs import awq_quantization_config
    return awq_quantization_config(args.quant_group_size)


def quant_engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments, the same names in minivllm and vLLM: quantization="fp8" (AWQ is
    read from the directory's config, so each engine picks its own AWQ kernel), kv_cache_dtype and
    distributed_executor_backend."""
    kw = {}
    if getattr(args, "quantization", None) == "fp8":
        kw["quantization"] = "fp8"
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    if getattr(args, "distributed_executor_backend", None):
        kw["distributed_executor_backend"] = args.distributed_executor_backend
    for k in ("kv_offloading_size", "kv_cache_memory_bytes",  # W12 (the same names in vLLM)
              "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel",
              "disable_custom_all_reduce"):
        if getattr(args, k, None) is not None:
            kw[k] = getattr(args, k)
    return kw


def in_fresh_process(fn, *args):
    """fn(*args) in a new (spawned) process, for runs that each start an engine on one GPU: an
    engine leaves CUDA memory behind in its process, which the next engine would count as used
    and plan no KV cache around. fn, its arguments and its result must pickle."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()
