"""The timed procedures of W1/W1-8B/W2/W4, written once against a small engine adapter, so that
minivllm and vLLM run exactly the same steps (the same warm-up, the same clocks, the same
counting). Pure Python: adapters do the engine work.

An adapter provides:
    engine, version: str
    prepare(param_dicts) -> engine SamplingParams objects (built before the clock starts)
    generate(prompts, prepared, want_ttft) -> list[GenResult], in prompt order
    reset_prefix_cache() -> bool
    prefix_counters() -> (queries, hits) in tokens, cumulative, or None where the engine has none
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Protocol

from minivllm.bench import workloads
from minivllm.bench.common import launch_time, log
from minivllm.bench.step_stats import PHASES
from minivllm.bench.workloads import Workload, first_token_params, warmup_workload


@dataclass
class GenResult:
    num_tokens: int
    prompt_len: int
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    ttft_s: float | None = None  # first output token time - arrival time, as the client sees it


class Adapter(Protocol):
    engine: str
    version: str

    def prepare(self, params: list[dict]) -> list: ...

    def generate(self, prompts: list[dict], prepared: list, want_ttft: bool = False) -> list[GenResult]: ...

    def reset_prefix_cache(self) -> bool: ...

    def prefix_counters(self) -> tuple[int, int] | None: ...


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def first_token_probe(adapter: Adapter, vocab_size: int) -> dict:
    """W6 measured in passing: the engine's first request (W2's 128-token prompt, one greedy
    token) right after LLM(...); seconds from this process's launch to its return."""
    wl = workloads.w2().fit_vocab(vocab_size)
    prepared = adapter.prepare([first_token_params(wl.params[0])])
    t = time.perf_counter()
    adapter.generate(wl.prompt_inputs(), prepared)
    now, dt = time.time(), time.perf_counter() - t
    launch, source = launch_time()
    out = {"first_request_s": dt, "launch_time_source": source,
           "launch_to_first_token_s": None if launch is None else now - launch}
    if launch is not None:
        log(f"{adapter.engine}: first token {now - launch:.1f} s after the process was launched")
    return out


def warm_up(adapter: Adapter, wl: Workload | None = None) -> float:
    prompts, params = warmup_workload((wl.meta.get("token_ids_mod_vocab") if wl is not None else None))
    t = time.perf_counter()
    adapter.generate(prompts, adapter.prepare(params))
    return time.perf_counter() - t


def timed_run(adapter: Adapter, wl: Workload, prepared: list, want_ttft: bool, label: str) -> dict:
    ok = adapter.reset_prefix_cache()
    before = adapter.prefix_counters()
    prompts = wl.prompt_inputs()
    t = time.perf_counter()
    outs = adapter.generate(prompts, prepared, want_ttft)
    dt = time.perf_counter() - t
    after = adapter.prefix_counters()
    n_out = sum(o.num_tokens for o in outs)
    r = {"label": label, "reset_prefix_cache": ok, "output_tokens": n_out, "wall_s": dt,
         "output_tok_per_s": n_out / dt, "total_tok_per_s": (n_out + wl.total_prompt_tokens) / dt,
         "output_tokens_ok": wl.expected_output_tokens is None or n_out == wl.expected_output_tokens,
         "per_request_lengths_ok": all(o.num_tokens == p["max_tokens"] for o, p in zip(outs, wl.params))}
    ttfts = [o.ttft_s for o in outs if o.ttft_s is not None]
    if ttfts:
        r.update(mean_ttft_s=statistics.fmean(ttfts), p50_ttft_s=_pct(ttfts, 0.5), p90_ttft_s=_pct(ttfts, 0.9),
                 max_ttft_s=max(ttfts), ttft_count=len(ttfts))
    cached = [o.num_cached_tokens for o in outs if o.num_cached_tokens is not None]
    if len(cached) == len(outs):
        r["cached_prompt_tokens"] = sum(cached)
        r["prefix_hit_rate_cached_tokens"] = sum(cached) / wl.total_prompt_tokens
    if before is not None and after is not None:
        q, h = after[0] - before[0], after[1] - before[1]
        r.update(prefix_cache_queries=q, prefix_cache_hits=h, prefix_hit_rate=(h / q) if q else None)
    log(f"{adapter.engine} {wl.name} {label}: {n_out} tokens in {dt:.2f} s = {n_out / dt:,.0f} output tok/s"
        + (f", mean TTFT {r['mean_ttft_s']:.3f} s" if "mean_ttft_s" in r else ""))
    if not r["output_tokens_ok"]:
        log(f"WARNING: {n_out} output tokens, expected {wl.expected_output_tokens}")
    return r


def run_throughput(adapter: Adapter, wl: Workload, repeats: int = 1, want_ttft: bool | None = None) -> dict:
    """W1 / W1-8B / W4: a short warm-up call, then one generate over every request (timed);
    repeats > 1 adds runs after reset_prefix_cache(). The figure is the first timed run."""
    want_ttft = (wl.name in ("W4", "W12")) if want_ttft is None else want_ttft
    prepared = adapter.prepare(wl.params)
    warm = warm_up(adapter, wl)
    runs = [timed_run(adapter, wl, prepared, want_ttft, "run1 (after warm-up, prefix cache reset)")]
    for i in range(1, repeats):
        runs.append(timed_run(adapter, wl, prepared, want_ttft, f"run{i + 1} (after reset_prefix_cache)"))
    first = runs[0]
    figures = {k: first[k] for k in ("output_tokens", "wall_s", "output_tok_per_s", "total_tok_per_s",
                                     "output_tokens_ok", "mean_ttft_s", "p50_ttft_s", "p90_ttft_s",
                                     "prefix_hit_rate", "prefix_hit_rate_cached_tokens") if k in first}
    figures["warmup_s"] = warm
    if len(runs) > 1:
        figures["best_output_tok_per_s"] = max(r["output_tok_per_s"] for r in runs)
    return {"figures": figures, "runs": runs}


# a step whose host waited less than this for the device found it already idle: with async
# scheduling the device then waited for the host (a host-bound step)
HOST_BOUND_WAIT_S = 50e-6


def step_phase_summary(steps: list[dict]) -> dict:
    """One generate's engine steps (run_minivllm's record_steps) -> milliseconds summed per host
    phase, the wall time of all steps and of the slowest, and how many steps were host-bound
    (waited under HOST_BOUND_WAIT_S for the device). Tells a slow timed run's cause: the device
    (more wait) or the host (more host-bound steps, a long slowest step)."""
    walls = [s.get("wall", 0.0) for s in steps]
    out = {"steps": len(steps), "wall_ms": round(sum(walls) * 1e3, 2),
           "slowest_step_ms": round(max(walls, default=0.0) * 1e3, 3),
           "host_bound_steps": sum(s.get("wait", 0.0) < HOST_BOUND_WAIT_S for s in steps)}
    for phase in PHASES:
        out[phase + "_ms"] = round(sum(s.get(phase, 0.0) for s in steps) * 1e3, 2)
    return out


def run_latency(adapter: Adapter, wl: Workload, reps: int = 5) -> dict:
    """W2: TTFT = median wall time of generate(max_tokens=1); decode tok/s = (n - 1) /
    (median T_n - median T_1); every timed run follows reset_prefix_cache()."""
    (prompt,), (params,) = wl.prompt_inputs(), wl.params
    n = params["max_tokens"]
    if n < 2:
        raise ValueError(f"W2 needs max_tokens >= 2 to time decode steps, got {n}")
    p1, pn = adapter.prepare([first_token_params(params)]), adapter.prepare([params])
    warm = warm_up(adapter, wl)
    adapter.generate([prompt], pn)  # warm this shape once
    adapter.generate([prompt], p1)
    t1s, tns, metric_ttfts, lengths = [], [], [], []
    for _ in range(reps):
        adapter.reset_prefix_cache()
        t = time.perf_counter()
        adapter.generate([prompt], p1)
        t1s.append(time.perf_counter() - t)
    record = getattr(adapter, "record_steps", None)  # minivllm: each timed run's engine steps
    phases = []
    for _ in range(reps):
        adapter.reset_prefix_cache()
        with (record() if record is not None else contextlib.nullcontext()) as steps:
            t = time.perf_counter()
            (o,) = adapter.generate([prompt], pn)
            tns.append(time.perf_counter() - t)
        if steps is not None:
            phases.append(step_phase_summary(steps))
        lengths.append(o.num_tokens)
        if o.ttft_s is not None:
            metric_ttfts.append(o.ttft_s)
    m1, mn = statistics.median(t1s), statistics.median(tns)
    step_s = max((mn - m1) / (n - 1), 1e-9)  # tiny smoke runs can time T_n <= T_1
    figures = {"ttft_s": m1, "total_s": mn, "output_tokens": lengths[-1], "output_tokens_ok": all(x == n for x in lengths),
               "decode_tok_per_s": 1.0 / step_s, "ms_per_token": 1e3 * step_s, "plain_tok_per_s": n / mn,
               "warmup_s": warm}
    if metric_ttfts:
        figures["ttft_metrics_s"] = statistics.median(metric_ttfts)
    details = {"t_max_tokens_1_s": t1s, f"t_max_tokens_{n}_s": tns,
               "method": "TTFT = median wall of generate(max_tokens=1); decode tok/s = (n-1)/(median T_n - median T_1)"}
    if phases:
        details[f"steps_max_tokens_{n}"] = phases  # one summary per timed run, in order
    log(f"{adapter.engine} W2: TTFT {m1 * 1e3:.1f} ms, decode {1 / step_s:.1f} tok/s ({step_s * 1e3:.2f} ms/token)")
    return {"figures": figures, "details": details}
