"""W6 startup: seconds from process start to the first generated token.

The parent stamps time.time() into MINIVLLM_BENCH_LAUNCH_TIME, launches a fresh Python child
(`python -m minivllm.bench.startup --child ...`), and the child creates the engine (dummy
weights, CUDA graphs on unless --enforce-eager), generates one token of W2's 128-token prompt
and reports time.time() at that moment. So the figure includes the interpreter's start, every
import, weight init, KV profiling, graph capture (and for vLLM torch.compile) and the first
step. The child also reports its own phases.

    python -m minivllm bench startup --model-config qwen3-0.6b
    python -m minivllm.bench.peers.vllm_runner startup --model-config llama-3.1-8b
"""

from __future__ import annotations

import time

_T_CHILD_START = time.time()  # as early as this module can stamp it (before torch is imported)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from minivllm.bench.common import LAUNCH_ENV  # noqa: E402


def _make_adapter(engine: str, model_dir: str, kw: dict):
    if engine == "minivllm":
        from minivllm.bench.run_minivllm import MinivllmAdapter
        return MinivllmAdapter(model_dir, **kw)
    if engine == "vllm":
        from minivllm.bench.peers.vllm_runner import VllmAdapter
        return VllmAdapter(model_dir, **kw)
    raise ValueError(f"engine must be minivllm or vllm, got {engine!r}")


def child_main(args) -> int:
    from minivllm.bench import model_dirs, workloads
    launch = float(os.environ.get(LAUNCH_ENV, _T_CHILD_START))
    t0 = time.time()
    if args.engine == "minivllm":
        import minivllm.llm  # noqa: F401  (torch and the engine)
    else:
        import vllm  # noqa: F401
    t_import = time.time()
    model_dir = model_dirs.write_model_dir(args.model_config)
    kw = {"max_model_len": args.max_model_len, "gpu_memory_utilization": args.gpu_memory_utilization,
          "enforce_eager": args.enforce_eager, "seed": 0}
    if args.engine == "minivllm" and args.device != "auto":
        kw["device"] = args.device
    adapter = _make_adapter(args.engine, model_dir, kw)
    t_ready = time.time()
    wl = workloads.w2(args.model_config).fit_vocab(model_dirs.load_config(args.model_config)["vocab_size"])
    prepared = adapter.prepare([workloads.first_token_params(wl.params[0])])
    (out,) = adapter.generate(wl.prompt_inputs(), prepared)
    t_first = time.time()
    res = {"launch_to_first_token_s": t_first - launch, "child_start_to_first_token_s": t_first - _T_CHILD_START,
           "interpreter_start_s": _T_CHILD_START - launch, "import_s": t_import - t0,
           "llm_init_s": t_ready - t_import, "first_generate_s": t_first - t_ready,
           "first_output_tokens": out.num_tokens, "engine_version": adapter.version,
           "engine_info": adapter.info() if hasattr(adapter, "info") else None}
    sys.stdout.write(json.dumps(res, default=str) + "\n")
    sys.stdout.flush()
    adapter.close()  # after the clock: stops vLLM's engine-core process
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: vLLM's can hang at exit


def measure(engine: str, model_config: str, max_model_len: int, gpu_memory_utilization: float,
            enforce_eager: bool, device: str = "auto", timeout: float = 590) -> dict:
    cmd = [sys.executable, "-m", "minivllm.bench.startup", "--child", "--engine", engine, "--model-config",
           model_config, "--max-model-len", str(max_model_len), "--gpu-memory-utilization",
           str(gpu_memory_utilization), "--device", device] + (["--enforce-eager"] if enforce_eager else [])
    env = dict(os.environ)
    env[LAUNCH_ENV] = repr(time.time())
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"startup child failed (rc {r.returncode}): {r.stderr[-3000:]}")
    from minivllm.bench.common import last_json_line
    res = last_json_line(r.stdout)
    res["child_command"] = " ".join(cmd)
    return res


def cmd_startup(args, engine: str = "minivllm") -> int:
    from minivllm.bench import model_dirs
    from minivllm.bench.common import device_name, emit, envelope, log
    engine = getattr(args, "engine", None) or engine
    res = measure(engine, args.model_config, args.max_model_len, args.gpu_memory_utilization, args.enforce_eager,
                  getattr(args, "device", "auto"), args.timeout)
    log(f"{engine} W6 {args.model_config}: {res['launch_to_first_token_s']:.1f} s from launch to the first token")
    figures = {k: res[k] for k in ("launch_to_first_token_s", "child_start_to_first_token_s", "import_s",
                                   "llm_init_s", "first_generate_s")}
    settings = {"max_model_len": args.max_model_len, "gpu_memory_utilization": args.gpu_memory_utilization,
                "enforce_eager": args.enforce_eager, "first_request": "W2's 128-token prompt, max_tokens=1, greedy"}
    result = envelope("W6", engine, res.get("engine_version"), model_dirs.config_name(args.model_config),
                      device_name(getattr(args, "device", "auto")), settings, None, figures, res)
    emit(result, args.output)
    return 0


def add_startup_args(p: argparse.ArgumentParser, with_device: bool = True) -> None:
    p.add_argument("--model-config", default="qwen3-0.6b")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--timeout", type=float, default=590)
    p.add_argument("--output", default=None)
    if with_device:
        p.add_argument("--device", default="auto")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.bench.startup")
    p.add_argument("--child", action="store_true", help="internal: the measured process")
    p.add_argument("--engine", default="minivllm", choices=["minivllm", "vllm"])
    add_startup_args(p)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args)
    return cmd_startup(args, args.engine)


if __name__ == "__main__":
    sys.exit(main())
