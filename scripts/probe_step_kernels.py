"""Development probe: GPU time per kernel category of rate-16-like W3 steps (Qwen3-8B shapes).

Builds the state W3 at 16 requests/s is in most of the time (Little's law: ~110 running
requests whose contexts are prompt U[100, 1024] plus part of an output U[100, 1024]), then
profiles single steps (async scheduling off, so one `step()` is one model step):

- a decode step of that batch;
- mixed steps: the same batch plus fresh prompts of the given lengths (rate 16's p99
  inter-token latency comes from these).

For each it prints the GPU kernel time by category (GEMM, attention, norms, ...) and the
achieved rate of the two big ones: GEMM TFLOP/s and attention KV bytes read per second.

    python3 scripts/probe_step_kernels.py [--batch 110] [--prompts 600 1024 1024,1024] [--eager]
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict

import torch

from minivllm.bench.model_dirs import write_model_dir
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.server.bench_serve import running_context_lengths

CATEGORIES = (  # first match wins; kernel names of cuBLAS and our Triton kernels
    ("attn_decode", ("_decode_split", "_decode_merge")),
    ("attn_prefill", ("_prefill_kernel",)),
    ("store_kv", ("_store_kv",)),
    ("norm", ("_rms_norm", "rms_norm")),
    ("rotary", ("_rotary",)),
    ("silu_mul", ("_silu_and_mul",)),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "cublas", "Kernel2")),
)


def category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def kernel_times(prof) -> dict[str, float]:
    """Self GPU time (ms) by category over the profiled region, plus the top 'other' names."""
    out: dict[str, float] = defaultdict(float)
    others: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if str(getattr(e, "device_type", "")).endswith("CPU"):
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us <= 0:
            continue
        cat = category(e.key)
        out[cat] += us / 1e3
        if cat == "other":
            others[e.key[:60]] += us / 1e3
    out = {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}
    out["total"] = round(sum(v for k, v in out.items()), 3)
    out["top_other"] = {k: round(v, 3) for k, v in sorted(others.items(), key=lambda kv: -kv[1])[:5]}
    return out


def profile_step(eng: LLMEngine) -> dict:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.step()
        torch.cuda.synchronize()
    res = kernel_times(prof)
    res["tokens"], res["seqs"] = eng.last_step["tokens"], eng.last_step["seqs"]
    return res


def gemm_flops(arch, tokens: int, sampled: int) -> float:
    h, inter, layers = arch.hidden_size, arch.intermediate_size, arch.num_layers
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_token = layers * (h * (q + 2 * kv) + q * h + 2 * h * inter + inter * h)
    return 2.0 * (tokens * per_token + sampled * h * arch.vocab_size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=110)
    ap.add_argument("--prompts", nargs="*", default=["600", "1024", "1024,1024", "2000"],
                    help="mixed steps: comma-separated prompt lengths added together")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    eng = LLMEngine.from_kwargs(model=write_model_dir(args.config), load_format="dummy", skip_tokenizer_init=True,
                                max_model_len=4096, serving=True, async_scheduling=False, enforce_eager=args.eager)
    arch = eng.config.model.arch
    rng = random.Random(0)
    long = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2000)
    ctx = running_context_lengths(args.batch, rng)
    for i, n in enumerate(ctx):
        eng.add_request(f"d{i}", [rng.randrange(10000) for _ in range(n)], long)
    while eng.last_step.get("tokens") != args.batch or eng.scheduler.num_waiting:
        eng.step()  # prefill the batch (8,192-token steps) until a step is pure decode
    for _ in range(5):
        eng.step()
    kv_bytes_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2  # K and V, bf16
    results = {"config": args.config, "batch": args.batch, "eager": args.eager,
               "mean_context": round(sum(ctx) / len(ctx)), "steps": []}

    def report(label: str, r: dict, prompt_tokens: int) -> None:
        r["label"] = label
        ms = r.get("gemm", 0.0)
        if ms:
            r["gemm_tflops"] = round(gemm_flops(arch, r["tokens"], r["seqs"]) / ms / 1e9, 1)
        attn_ms = r.get("attn_decode", 0.0) + r.get("attn_prefill", 0.0)
        if attn_ms:
            kv = (sum(ctx) + prompt_tokens) * kv_bytes_per_token
            r["attn_kv_tb_s"] = round(kv / attn_ms / 1e9, 2)
        results["steps"].append(r)
        print(json.dumps(r), flush=True)

    for _ in range(args.repeat):
        report("decode", profile_step(eng), 0)
    for k, spec in enumerate(args.prompts):
        lens = [int(x) for x in spec.split(",")]
        for rep in range(args.repeat):
            for j, n in enumerate(lens):
                eng.add_request(f"p{k}_{rep}_{j}", [rng.randrange(10000) for _ in range(n)], long)
            report(f"mixed {spec}", profile_step(eng), sum(lens))
            for j in range(len(lens)):
                eng.abort_request(f"p{k}_{rep}_{j}")
            eng.step()
    if eng.executor.runner.graphs is not None:
        results["graph_replays"] = dict(eng.executor.runner.graphs.replays)
    print(json.dumps({k: v for k, v in results.items() if k != "steps"}))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
