"""`minivllm bench parallel-check`: does a model give the same answers sharded over several ranks?

The multi-GPU run's correctness step (issue 27, item 6): the same checkpoint under several
layouts (tp=1 first, the reference; then tp=N, pp=N, tp x pp), each in its own engine, on the
same prompts, and two figures per layout against the reference:

- greedy agreement: the share of generated positions whose token equals the reference's at the
  same position (a divergence early on costs every later position; also reported: how many
  outputs are identical end to end);
- teacher-forced logprobs: `prompt_logprobs` of the same prompt tokens, so both layouts score
  exactly the same inputs; the largest and mean absolute difference of the prompt token's
  logprob, and how often the top-1 token under the reference is also top-1 under the layout.

Exact equality is not expected in bf16 (a tp all-reduce sums partial products in a different
order), so the figures are reported, not asserted; the CPU test asserts fp32 equality.

    minivllm bench parallel-check --model DIR --layouts tp1,tp3,pp2
    minivllm bench parallel-check --model-config qwen3-8b --num-layers 4 --layouts tp1,tp2,tp4

--model-config writes a random checkpoint (seeded; `--num-layers` keeps the shapes of every layer
and the head, fewer layers) to a temporary directory first, so every layout loads the same
weights (dummy weights would differ per shard).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import tempfile
import time

from minivllm.bench.common import emit, envelope, in_fresh_process, log

_LAYOUT = re.compile(r"^(?:tp(\d+))?(?:pp(\d+))?$")


def parse_layout(text: str) -> tuple[int, int]:
    """'tp2' -> (2, 1), 'pp2' -> (1, 2), 'tp2pp2' -> (2, 2), 'tp1' -> (1, 1)."""
    m = _LAYOUT.match(text.strip())
    if not m or not (m.group(1) or m.group(2)):
        raise argparse.ArgumentTypeError(f"--layouts: {text!r} is not tpN, ppN or tpNppM")
    return int(m.group(1) or 1), int(m.group(2) or 1)


def random_checkpoint(model_config: str, num_layers: int | None, dtype: str, seed: int, device: str) -> str:
    """A Hugging Face directory with seeded random weights for a bundled config (safetensors).

    The tensor names and shapes come from transformers' model built on the meta device (nothing
    allocated); each tensor is drawn on the GPU when there is one (N(0, 0.02), norms 1): seconds
    for Qwen3-8B shapes, where initialising the real module tree takes minutes."""

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from minivllm.bench.model_dirs import write_model_dir
    src = write_model_dir(model_config)
    cfg = AutoConfig.from_pretrained(src)
    if num_layers is not None:
        cfg.num_hidden_layers = num_layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:num_layers]
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    gen_device = "cuda" if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()) else "cpu"
    gen = torch.Generator(gen_device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, device=gen_device)
        else:
            t = torch.randn(shape, generator=gen, device=gen_device) * 0.02
        tensors[name] = t.to(getattr(torch, dtype)).cpu()
    out = tempfile.mkdtemp(prefix=f"parallel-check-{model_config}-")
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    conf = cfg.to_dict()
    conf["torch_dtype"] = dtype
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(conf, f, indent=1)
    return out


def make_prompts(vocab_size: int, num_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    top = min(vocab_size, 32000)  # ordinary token ids of any tokenizer; never the padding rows
    return [[rng.randrange(100, top) for _ in range(prompt_len)] for _ in range(num_prompts)]


def run_layout(model: str, tp: int, pp: int, prompts: list[list[int]], args) -> dict:
    """One engine with this layout: greedy tokens and the prompt tokens' teacher-forced logprobs."""
    import torch

    from minivllm import LLM, SamplingParams
    kw = dict(model=model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              tensor_parallel_size=tp, pipeline_parallel_size=pp, enforce_eager=args.enforce_eager,
              enable_prefix_caching=False, seed=0)
    if tp * pp > 1:
        kw["distributed_executor_backend"] = args.backend
    if args.kv_cache_memory_bytes:
        kw["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.skip_tokenizer_init:
        kw["skip_tokenizer_init"] = True
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup = time.perf_counter() - t0
    inputs = [{"prompt_token_ids": p} for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, greedy, use_tqdm=False)]
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=args.prompt_logprobs)
    prompt_lps = []
    for p, o in zip(prompts, llm.generate(inputs, scored, use_tqdm=False)):
        rows = []
        for tok, lp in zip(p[1:], (o.prompt_logprobs or [None])[1:]):  # position 0 has no logprob
            if lp is None:
                rows.append(None)
                continue
            top1 = max(lp.items(), key=lambda kv: kv[1].logprob)[0]
            rows.append((lp[tok].logprob if tok in lp else None, top1))
        prompt_lps.append(rows)
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"tokens": tokens, "prompt_lps": prompt_lps, "startup_s": round(startup, 1)}


def compare(ref: dict, got: dict) -> dict:
    """Greedy agreement and teacher-forced logprob differences of `got` against `ref`."""
    same_pos = total = identical = 0
    first_div = []
    for a, b in zip(ref["tokens"], got["tokens"]):
        total += len(a)
        same_pos += sum(x == y for x, y in zip(a, b))
        identical += a == b
        first_div.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
    diffs, top1_same, top1_total = [], 0, 0
    for ra, rb in zip(ref["prompt_lps"], got["prompt_lps"]):
        for a, b in zip(ra, rb):
            if a is None or b is None:
                continue
            if a[0] is not None and b[0] is not None:
                diffs.append(abs(a[0] - b[0]))
            top1_total += 1
            top1_same += a[1] == b[1]
    return {"greedy_position_match_rate": round(same_pos / max(total, 1), 4),
            "greedy_outputs_identical": f"{identical}/{len(ref['tokens'])}",
            "mean_first_divergence": round(sum(first_div) / max(len(first_div), 1), 1),
            "prompt_logprob_max_abs_diff": round(max(diffs), 5) if diffs else None,
            "prompt_logprob_mean_abs_diff": round(sum(diffs) / len(diffs), 6) if diffs else None,
            "prompt_top1_match_rate": round(top1_same / max(top1_total, 1), 4)}


def cmd_parallel_check(args) -> int:
    layouts = [parse_layout(x) for x in args.layouts.split(",") if x.strip()]
    if layouts[0] != (1, 1):
        layouts.insert(0, (1, 1))
    made = None
    if args.model:
        model, name = args.model, os.path.basename(os.path.normpath(args.model))
    else:
        t0 = time.perf_counter()
        model = made = random_checkpoint(args.model_config, args.num_layers, args.dtype if args.dtype != "auto"
                                         else "bfloat16", args.seed, args.device)
        name = args.model_config + (f" ({args.num_layers} layers)" if args.num_layers else "")
        log(f"random checkpoint for {name} written in {time.perf_counter() - t0:.1f} s: {model}")
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = make_prompts(vocab, args.num_prompts, args.prompt_len, args.seed)
    runs, report = {}, {}
    for tp, pp in layouts:
        key = f"tp{tp}pp{pp}"
        log(f"layout {key}: starting")
        runs[key] = in_fresh_process(run_layout, model, tp, pp, prompts, args)
        if key != "tp1pp1":
            report[key] = dict(compare(runs["tp1pp1"], runs[key]), startup_s=runs[key]["startup_s"])
            log(f"layout {key} vs tp1: {report[key]}")
    settings = {"layouts": list(runs), "dtype": args.dtype, "num_prompts": args.num_prompts,
                "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "backend": args.backend,
                "enforce_eager": args.enforce_eager}
    from minivllm.bench.common import device_name
    emit(envelope("parallel-check", "minivllm", None, name, device_name(args.device), settings, None, report),
         args.output)
    if made and not args.keep_checkpoint:
        import shutil
        shutil.rmtree(made, ignore_errors=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("parallel-check", help="tp/pp layouts vs tp=1 on the same weights: greedy match rate and "
                                              "teacher-forced logprob differences")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Hugging Face directory (real weights)")
    src.add_argument("--model-config", help="a bundled config (qwen3-8b, ...): random seeded weights")
    p.add_argument("--num-layers", type=int, default=None, help="with --model-config: keep only N layers")
    p.add_argument("--layouts", default="tp1,tp2", help="comma-separated tpN / ppN / tpNppM; tp1 is the reference")
    p.add_argument("--backend", default="mp", choices=["mp", "ray"], help="distributed_executor_backend")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-logprobs", type=int, default=1, help="top-k of each prompt position (1: top-1 only)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="random checkpoints have no tokenizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-checkpoint", action="store_true")
    p.add_argument("--output", default=None, help="also write the JSON result to this file")
    p.set_defaults(bench_func=cmd_parallel_check)


# ---- per-step time at tp=N (issue 20's CPU figure) ----------------------------------------------------
TP_STEP_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]


def cmd_tp_steps(args) -> int:
    """Per-step decode time of the bundled model at each tensor_parallel_size (N > 1: N mp workers)."""
    for tp in (int(x) for x in args.tp.split(",")):
        for batch, ms in in_fresh_process(_tp_step_times, tp, args.device, args.steps):
            print(f"tp={tp} batch={batch}: {ms:.1f} ms per step ({args.steps} decode steps, prompt included)",
                  flush=True)
    return 0


def _tp_step_times(tp: int, device: str, steps: int) -> list[tuple[int, float]]:
    from minivllm import LLM, SamplingParams
    llm = LLM(dtype="float32" if device == "cpu" else "auto", device=device, tensor_parallel_size=tp,
              max_model_len=512)
    llm.generate(TP_STEP_PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    out = []
    for batch in (1, 4):
        t = time.perf_counter()
        llm.generate(TP_STEP_PROMPTS[:batch], params, use_tqdm=False)
        out.append((batch, (time.perf_counter() - t) / steps * 1000))
    llm.llm_engine.shutdown()
    return out


def add_tp_steps_parser(sub) -> None:
    p = sub.add_parser("tp-steps", help="per-step decode time of the default model at tp=1,3,... (issue 20's "
                                        "CPU figure)")
    p.add_argument("--tp", default="1,3", help="comma-separated tensor_parallel_size values")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=64)
    p.set_defaults(bench_func=cmd_tp_steps)
