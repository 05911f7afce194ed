"""W7 (structured output) on the GPU: minivllm and vLLM 0.20.0 (xgrammar backend), one process
each, the same requests (minivllm/bench/w7.py), then one comparison.

    bash scripts/gpu_w7.sh                               # both engines (stages xgrammar, vLLM)
    python3 scripts/gpu_w7.py --engine minivllm          # one engine, prints RESULT {json}
    python3 scripts/gpu_w7.py --engine minivllm --num-requests 16 --max-tokens 64   # quick check

Per engine, after one unconstrained warm-up and one constrained priming request (it builds the
grammar backend's tokenizer tables, a one-off):
1. TTFT probe: W1's first prompt with max_tokens=1, unconstrained, then each of the 8 schemas
   first seen (cold grammar cache) and repeated (warm); means reported.
2. Constrained run: the 256 W1 requests, request i under schema i mod 8, max_tokens 512,
   temperature 0.6 (seed i): output tok/s, wall s, outputs that finish with "stop" and validate.
3. Unconstrained twin run: the same requests, no constraint, ignore_eos, each with exactly the
   token count its constrained run produced: the same schedule, so
   overhead = constrained wall / unconstrained wall - 1 is the grammar's cost per token
   (target <= 3 % at batch 256; constrained throughput >= 1.0x vLLM's).
4. With --trace-requests N (minivllm): the first N requests again, constrained then their twins
   (at most --trace-max-tokens tokens each), under the torch profiler: GPU kernel time per
   engine step and the top kernels of each, i.e. whether a constrained step's GPU part is longer
   than an unconstrained one's or the GPU waits between steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from minivllm.bench import w7  # noqa: E402


class MinivllmEngine:
    name = "minivllm"

    def __init__(self, model_dir: str, max_model_len: int, device: str = "auto") -> None:
        import minivllm
        from minivllm import LLM
        self.version = minivllm.__version__
        t = time.perf_counter()
        dtype = "float32" if device == "cpu" else "bfloat16"
        self.llm = LLM(model=model_dir, load_format="dummy", dtype=dtype, max_model_len=max_model_len, seed=0,
                       device=device)
        self.startup_s = time.perf_counter() - t
        self._count_step_phases()

    def _count_step_phases(self) -> None:
        """Sums the engine's per-step phase times (LLMEngine.last_step: schedule, launch, wait,
        update, outputs) over the steps since the last take_phases(): where a step's host time
        goes, constrained vs unconstrained."""
        engine = self.llm.llm_engine
        step = engine.step
        self._phases: dict[str, float] = {}
        self._steps = 0
        self._records: list[dict] = []  # every step's phases, its rows and wall time (steady-state medians)

        def counted_step():
            t = time.perf_counter()
            out = step()
            self._steps += 1
            for k, v in engine.last_step.items():
                if isinstance(v, float):
                    self._phases[k] = self._phases.get(k, 0.0) + v
            self._records.append(dict(engine.last_step, wall=time.perf_counter() - t, start=t))
            return out
        engine.step = counted_step

    steps_dir: str | None = None  # where take_phases(label) writes every step's record (--steps-dir)

    def take_phases(self, label: str | None = None) -> dict:
        """Mean ms per step of each phase since the last call, and the step count (None for
        vLLM, whose engine has no such record); "steady" holds the median of each phase and of
        the step's wall time over the full decode steps alone (one token per sequence, at least
        3/4 of the run's largest batch): the means mix in the prefill steps and the tail."""
        if not hasattr(self, "_phases"):
            return None
        out = {k: round(1e3 * v / max(self._steps, 1), 3) for k, v in self._phases.items()}
        out["steps"] = self._steps
        out["steady"] = steady_phases(self._records)
        if self.steps_dir and label:
            write_step_records(os.path.join(self.steps_dir, f"w7-steps-{label}.jsonl"), self._records)
        # how many steps took the pipelined and the early (beside-the-fill) paths since the last call
        engine = self.llm.llm_engine
        counts = {"pipelined_steps": engine.num_pipelined_steps, "early_schedules": engine.num_early_schedules}
        last = getattr(self, "_counts", dict.fromkeys(counts, 0))
        out.update({k: v - last[k] for k, v in counts.items()})
        self._counts = counts
        self._phases, self._steps, self._records = {}, 0, []
        return out

    @staticmethod
    def param_classes() -> tuple[type, type]:
        from minivllm import SamplingParams, StructuredOutputsParams
        return SamplingParams, StructuredOutputsParams

    def params(self, p: dict):
        """A W7 param dict (its "json_schema" as the engine's structured-output params)."""
        sampling, structured = self.param_classes()
        p = dict(p)
        schema = p.pop("json_schema", None)
        return sampling(**p, structured_outputs=structured(json=schema) if schema is not None else None)

    def generate(self, prompts: list[list[int]], params: list[dict]) -> list:
        sps = [self.params(p) for p in params]
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)


def steady_phases(records: list[dict]) -> dict:
    """Median ms of each phase (and of the step's wall time) over the decode steps that carry
    one token per sequence and at least 3/4 of the largest such batch; their count."""
    decode = [r for r in records if r.get("seqs") and r.get("tokens") == r.get("seqs")]
    if not decode:
        return {"steps": 0}
    top = max(r["seqs"] for r in decode)
    full = [r for r in decode if r["seqs"] >= 0.75 * top]
    keys = sorted({k for r in full for k, v in r.items() if isinstance(v, float)})
    out = {k: round(1e3 * statistics.median(r.get(k, 0.0) for r in full), 3) for k in keys}
    out.update(steps=len(full), seqs_median=statistics.median(r["seqs"] for r in full))
    return out


def write_step_records(path: str, records: list[dict]) -> None:
    """One JSON line a step: its rows, tokens, phase ms, wall ms and start (ms from the first
    step's), to find which steps a run's time goes to (lease 13: W7's full decode steps took
    18.3 ms constrained against 17.8 unconstrained while the runs differed by 51 %)."""
    t0 = records[0]["start"] if records else 0.0
    with open(path, "w") as f:
        for r in records:
            row = {k: (round(1e3 * v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "start"}
            row["start"] = round(1e3 * (r["start"] - t0), 3)
            f.write(json.dumps(row) + "\n")


class VllmEngine(MinivllmEngine):
    name = "vllm"

    def __init__(self, model_dir: str, max_model_len: int, device: str = "auto") -> None:
        import vllm
        from vllm import LLM
        self.version = vllm.__version__
        t = time.perf_counter()
        self.llm = LLM(model=model_dir, tokenizer=model_dir, load_format="dummy", dtype="bfloat16",
                       max_model_len=max_model_len, seed=0, structured_outputs_config={"backend": "xgrammar"})
        self.startup_s = time.perf_counter() - t

    @staticmethod
    def param_classes() -> tuple[type, type]:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
        return SamplingParams, StructuredOutputsParams


def _timed(engine, prompts, params, cold: bool = False) -> tuple[float, list]:
    """Wall seconds and outputs of one generate call; cold: with the prefix cache emptied first.

    The throughput runs are timed cold. Lease 13 found why: the unconstrained twin reuses the
    constrained run's 256 prompts, and with a warm prefix cache it skipped their whole prefill
    (~144k tokens of Qwen3-8B, ~3 s of steps in lease 14's records), which the constrained run paid. The full decode
    steps took 18.3 ms constrained against 17.8 unconstrained, but the runs differed by 51 %:
    every W7 "overhead" before lease 13 (45-53 % ours, 78 % vLLM's) was mostly that prefill."""
    if cold:
        engine.llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - t, outs


def ttft_probe(engine, prompt: list[int]) -> dict:
    one = {"temperature": 0.0, "max_tokens": 1}
    plain = [_timed(engine, [prompt], [one])[0] for _ in range(3)]
    cold, warm = {}, {}
    for name, schema in w7.ttft_schemas():
        cold[name] = _timed(engine, [prompt], [dict(one, json_schema=schema)])[0]
        warm[name] = min(_timed(engine, [prompt], [dict(one, json_schema=schema)])[0] for _ in range(2))
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    return {"ttft_unconstrained_s": min(plain), "ttft_cold_mean_s": mean(cold), "ttft_warm_mean_s": mean(warm),
            "ttft_cold_s": cold, "ttft_warm_s": warm}


def throughput(engine, n: int, max_tokens: int) -> dict:
    prompts, params, names = w7.w7_requests()
    prompts, params, names = prompts[:n], params[:n], names[:n]
    for p in params:
        p["max_tokens"] = min(p["max_tokens"], max_tokens)
    phases = getattr(engine, "take_phases", lambda label=None: None)
    phases()
    wall_c, outs = _timed(engine, prompts, params, cold=True)
    phases_c = phases("constrained")
    counts = [len(o.outputs[0].token_ids) for o in outs]
    wall_u, outs_u = _timed(engine, prompts, w7.unconstrained_twins(params, counts), cold=True)
    phases_u = phases("unconstrained")
    assert [len(o.outputs[0].token_ids) for o in outs_u] == counts, "the twin run must produce the same tokens"
    stopped = [(o.outputs[0].text, p["json_schema"]) for o, p in zip(outs, params) if o.outputs[0].finish_reason == "stop"]
    valid = sum(w7.validates(text, schema) for text, schema in stopped)
    total = sum(counts)
    return {"requests": n, "output_tokens": total, "constrained_wall_s": wall_c, "unconstrained_wall_s": wall_u,
            "constrained_tok_s": total / wall_c, "unconstrained_tok_s": total / wall_u,
            "constrained_ms_per_token": 1e3 * wall_c / total, "unconstrained_ms_per_token": 1e3 * wall_u / total,
            "overhead": wall_c / wall_u - 1.0, "finished_stop": len(stopped), "valid": valid,
            "valid_share_of_stop": valid / len(stopped) if stopped else None,
            "step_phase_ms_constrained": phases_c, "step_phase_ms_unconstrained": phases_u}


def kernel_time(engine, prompts, params, top: int = 8, trace_path: str | None = None) -> dict:
    """The generate call under the torch profiler: engine steps, GPU kernel ms per step, wall ms
    per step, and the kernels that took most of it; with trace_path also the whole timeline as
    a gzipped Chrome trace (where the GPU waits between kernels, and for which host call)."""
    import torch

    from minivllm.engine.profiler import kernel_times
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    engine.take_phases()
    with torch.profiler.profile(activities=acts) as prof:
        wall, _ = _timed(engine, prompts, params, cold=True)
    steps = max(engine.take_phases()["steps"], 1)
    kernels = kernel_times(prof)
    if trace_path:
        import gzip
        import shutil
        prof.export_chrome_trace(trace_path)
        with open(trace_path, "rb") as src, gzip.open(trace_path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace_path)
    return {"steps": steps, "gpu_kernel_ms_per_step": round(sum(k["ms"] for k in kernels) / steps, 3),
            "wall_ms_per_step": round(1e3 * wall / steps, 3), "top_kernels": kernels[:top]}


def trace(engine, n: int, max_tokens: int, trace_dir: str | None = None) -> dict:
    prompts, params, _ = w7.w7_requests()
    prompts, params = prompts[:n], params[:n]
    for p in params:
        p["max_tokens"] = min(p["max_tokens"], max_tokens)
    path = (lambda name: os.path.join(trace_dir, f"w7-trace-{name}.json")) if trace_dir else (lambda name: None)
    constrained = kernel_time(engine, prompts, params, trace_path=path("constrained"))
    outs = engine.generate(prompts, params)  # the twins need the token counts (not traced)
    twins = w7.unconstrained_twins(params, [len(o.outputs[0].token_ids) for o in outs])
    return {"trace_constrained": constrained,
            "trace_unconstrained": kernel_time(engine, prompts, twins, trace_path=path("unconstrained"))}


def run_engine(kind: str, args) -> dict:
    model_dir = w7.write_model_dir(base=args.model_config)
    engine = (MinivllmEngine if kind == "minivllm" else VllmEngine)(model_dir, 4096, args.device)
    engine.steps_dir = args.steps_dir
    prompt = w7.w7_requests()[0][0]
    engine.generate([prompt], [{"temperature": 0.6, "max_tokens": 16}])  # warm-up
    t = time.perf_counter()  # the grammar backend's one-off setup (tokenizer tables)
    engine.generate([prompt], [{"temperature": 0.0, "max_tokens": 1,
                                "json_schema": {"type": "object", "properties": {"primer": {"type": "integer"}}}}])
    first_constrained_s = time.perf_counter() - t
    res = {"engine": kind, "version": engine.version, "startup_s": engine.startup_s,
           "first_constrained_request_s": first_constrained_s}
    res.update(ttft_probe(engine, prompt))
    res.update(throughput(engine, args.num_requests, args.max_tokens))
    if kind == "minivllm" and args.trace_requests:
        res.update(trace(engine, args.trace_requests, args.trace_max_tokens, args.trace_dir))
    if kind == "minivllm":  # which bitmask fill the engine measured cheaper (mean s per row)
        backend = engine.llm.llm_engine.structured._backend
        choice = getattr(backend, "_fill_choice", None)
        if choice is not None:
            res["fill_s_per_row"] = dict(choice.cost)
    return res


def run_both(args) -> int:
    """Each engine in its own process; vLLM from --vllm-site, minivllm with --xgrammar-site."""
    results = {}
    for kind, extra in (("minivllm", args.xgrammar_site), ("vllm", args.vllm_site)):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (extra, ROOT, os.environ.get("PYTHONPATH")) if p))
        cmd = [sys.executable, __file__, "--engine", kind, "--num-requests", str(args.num_requests),
               "--max-tokens", str(args.max_tokens), "--model-config", args.model_config,
               "--trace-requests", str(args.trace_requests), "--trace-max-tokens", str(args.trace_max_tokens)]
        cmd += ["--trace-dir", args.trace_dir] if args.trace_dir else []
        cmd += ["--steps-dir", args.steps_dir] if args.steps_dir else []
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            print(f"{kind}: timed out after {args.timeout_s} s", flush=True)
            continue
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{kind} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}", flush=True)
            continue
        results[kind] = json.loads(line[len("RESULT "):])
        print(line, flush=True)
    print(summary(results), flush=True)
    return 0 if "minivllm" in results else 1


def summary(results: dict) -> str:
    keys = ["startup_s", "first_constrained_request_s", "ttft_unconstrained_s", "ttft_cold_mean_s", "ttft_warm_mean_s",
            "output_tokens", "constrained_tok_s", "unconstrained_tok_s", "constrained_ms_per_token",
            "unconstrained_ms_per_token", "overhead", "finished_stop", "valid_share_of_stop"]
    lines = ["W7 " + " | ".join(f"{k}: {v['version']}" for k, v in results.items())]
    for k in keys:
        lines.append(f"  {k:32s}" + "".join(f"{_fmt(r.get(k)):>14s}" for r in results.values()))
    if "minivllm" in results and "vllm" in results:
        ratio = results["minivllm"]["constrained_tok_s"] / results["vllm"]["constrained_tok_s"]
        lines.append(f"  constrained throughput minivllm / vllm: {ratio:.2f}x")
    return "\n".join(lines)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["minivllm", "vllm", "both"], default="both")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=w7.W7_MAX_TOKENS)
    ap.add_argument("--model-config", default="qwen3-8b", help="shapes (tiny-llama: a CPU smoke test)")
    ap.add_argument("--device", default="auto", help="minivllm only (cpu: a smoke test)")
    ap.add_argument("--vllm-site", default="/tmp/vllm-site")
    ap.add_argument("--xgrammar-site", default="/tmp/xgr-site")
    ap.add_argument("--timeout-s", type=int, default=270, help="per engine, with --engine both")
    ap.add_argument("--trace-requests", type=int, default=0, help="minivllm: kernel times of this many requests (0: none)")
    ap.add_argument("--trace-max-tokens", type=int, default=48)
    ap.add_argument("--trace-dir", default=None, help="with --trace-requests: write gzipped Chrome traces here")
    ap.add_argument("--steps-dir", default=None, help="minivllm: write every step's record of the throughput runs here")
    args = ap.parse_args()
    if args.engine == "both":
        return run_both(args)
    print("RESULT " + json.dumps(run_engine(args.engine, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
