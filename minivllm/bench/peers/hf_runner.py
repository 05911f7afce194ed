"""Hugging Face transformers `generate` as the baseline peer, on the same workload data.

    python3 -m minivllm.bench.peers.hf_runner throughput --workload W1      # static batches of 64
    python3 -m minivllm.bench.peers.hf_runner decode --model-config qwen3-0.6b   # batch-1 decode
    python3 -m minivllm.bench.peers.hf_runner throughput --model-config tiny-llama --device cpu \
        --num-requests 4 --max-output 8                                      # CPU smoke run

Random-init weights from the same config (`AutoModelForCausalLM.from_config`, built on the
device), bf16 on the GPU, attention "sdpa". W1: the 256 requests in order, in static batches of
64, left-padded; each batch generates max(max_tokens of the batch) tokens with EOS disabled
(temperature 0.6, top_k 0, top_p 1, one torch seed for the run), and the figure counts each
request's own max_tokens (133,966 in all: what the other engines produce), not the overrun of
the shorter requests in a batch, over the wall time of all batches. Batch-1 decode: W2's
128-token prompt, greedy; TTFT = median T(max_new_tokens=1); decode tok/s = (n - 1) /
(median T_n - median T_1), as for the other engines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from minivllm.bench import model_dirs, workloads
from minivllm.bench.common import add_workload_args, device_name, emit, envelope, log


def _resolve_device(device: str) -> str:
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def build_model(model_config: str, device: str, dtype_name: str):
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[dtype_name]
    config = AutoConfig.from_pretrained(model_dirs.write_model_dir(model_config))
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, attn_implementation="sdpa")
    model = model.to(device=device, dtype=dtype).eval()
    gc = model.generation_config
    gc.eos_token_id = None  # ignore_eos: never stop early
    gc.pad_token_id = 0
    init_s = time.perf_counter() - t
    return model, {"init_s": init_s, "dtype": str(dtype), "attn_implementation": "sdpa",
                   "transformers": transformers.__version__, "torch": torch.__version__}


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _generate(model, prompts: list[list[int]], max_new: int, device: str, sample: bool):
    import torch
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kw = dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             pad_token_id=0, **kw)
    return out.shape[1] - width


def cmd_throughput(args) -> int:
    import torch
    if len(args.workload) != 1:
        raise SystemExit("hf_runner throughput runs one workload at a time")
    wl = workloads.get(args.workload[0], args.model_config).scaled(args.num_requests, args.max_output,
                                                                   args.max_prompt)
    cfg = model_dirs.load_config(wl.model_config)
    wl = wl.fit_vocab(cfg["vocab_size"])
    device = _resolve_device(args.device)
    model, info = build_model(wl.model_config, device, args.dtype)
    log(f"HF model ready in {info['init_s']:.1f} s ({info['transformers']})")
    torch.manual_seed(args.seed)
    t = time.perf_counter()
    (warm_prompt,), _ = workloads.warmup_workload(wl.meta.get("token_ids_mod_vocab"))
    _generate(model, [warm_prompt["prompt_token_ids"]], 16, device, sample=True)
    _sync(device)
    warm = time.perf_counter() - t
    batches, useful, generated = [], 0, 0
    t_all = time.perf_counter()
    for start in range(0, wl.num_requests, args.batch_size):
        prompts = wl.prompts[start:start + args.batch_size]
        wants = [p["max_tokens"] for p in wl.params[start:start + args.batch_size]]
        t = time.perf_counter()
        got = _generate(model, prompts, max(wants), device, sample=True)
        _sync(device)
        dt = time.perf_counter() - t
        u = sum(min(w, got) for w in wants)
        useful += u
        generated += got * len(prompts)
        batches.append({"first_request": start, "size": len(prompts), "max_new_tokens": max(wants),
                        "generated_per_row": got, "useful_tokens": u, "wall_s": dt})
        log(f"HF batch {start // args.batch_size + 1}: {len(prompts)} x {got} tokens in {dt:.1f} s")
    wall = time.perf_counter() - t_all
    figures = {"output_tokens": useful, "wall_s": wall, "output_tok_per_s": useful / wall,
               "generated_tokens_incl_overrun": generated, "generated_tok_per_s_incl_overrun": generated / wall,
               "output_tokens_ok": wl.expected_output_tokens is None or useful == wl.expected_output_tokens,
               "warmup_s": warm, "startup_s": info["init_s"]}
    log(f"HF {wl.name}: {useful} useful tokens in {wall:.1f} s = {useful / wall:,.0f} output tok/s")
    settings = {"batch_size": args.batch_size, "padding": "left", "sampling": "temperature 0.6, top_k 0, top_p 1",
                "eos": "disabled (generation_config.eos_token_id = None, min_new_tokens = max_new_tokens)",
                "device": device, "seed": args.seed, **info}
    emit(envelope(wl.name, "hf", info["transformers"], model_dirs.config_name(wl.model_config), device_name(device),
                  settings, wl.summary(), figures, {"batches": batches}), args.output)
    return 0 if figures["output_tokens_ok"] else 1


def cmd_decode(args) -> int:
    wl = workloads.w2(args.model_config).scaled(None, args.max_output)
    cfg = model_dirs.load_config(wl.model_config)
    wl = wl.fit_vocab(cfg["vocab_size"])
    device = _resolve_device(args.device)
    model, info = build_model(wl.model_config, device, args.dtype)
    log(f"HF model ready in {info['init_s']:.1f} s")
    prompt, n = wl.prompts[0], wl.params[0]["max_tokens"]

    def timed(k: int) -> tuple[float, int]:
        t = time.perf_counter()
        got = _generate(model, [prompt], k, device, sample=False)
        _sync(device)
        return time.perf_counter() - t, got

    timed(n)  # warm this shape
    t1s = [timed(1)[0] for _ in range(args.reps)]
    runs = [timed(n) for _ in range(args.reps)]
    tns = [r[0] for r in runs]
    m1, mn = statistics.median(t1s), statistics.median(tns)
    step = max((mn - m1) / max(n - 1, 1), 1e-9)
    figures = {"ttft_s": m1, "total_s": mn, "output_tokens": runs[-1][1], "output_tokens_ok": runs[-1][1] == n,
               "decode_tok_per_s": 1 / step, "ms_per_token": 1e3 * step, "plain_tok_per_s": n / mn,
               "startup_s": info["init_s"]}
    log(f"HF batch-1 decode on {wl.model_config}: {1 / step:.1f} tok/s ({1e3 * step:.2f} ms/token)")
    emit(envelope("HF-decode", "hf", info["transformers"], model_dirs.config_name(wl.model_config),
                  device_name(device), {"device": device, "reps": args.reps, **info}, wl.summary(), figures,
                  {"t_max_new_1_s": t1s, f"t_max_new_{n}_s": tns}), args.output)
    return 0 if figures["output_tokens_ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minivllm.bench.peers.hf_runner",
                                description="Hugging Face transformers generate as the baseline peer.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("throughput", help="W1 in static batches")
    add_workload_args(t, ["W1", "W1-8B"], "W1")
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_throughput)
    d = sub.add_parser("decode", help="batch-1 decode (W2's prompt, greedy)")
    d.add_argument("--model-config", default="qwen3-0.6b")
    d.add_argument("--max-output", type=int, default=None, help="default: 256")
    d.add_argument("--reps", type=int, default=3)
    d.add_argument("--output", default=None)
    d.set_defaults(func=cmd_decode)
    for s in (t, d):
        s.add_argument("--device", default="auto")
        s.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
