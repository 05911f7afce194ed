"""Issue 23's benchmark variants of the throughput workloads, shared by minivllm's runner and the
vLLM runner (docs/perf.md, "API breadth"):

- `--num-loras N --lora-rank R`: N dummy rank-R LoRA adapters on every q/k/v/o/gate/up/down of
  the model, written as PEFT directories next to the dummy model; request i runs with adapter
  i mod N (both engines: enable_lora, max_loras=N, max_lora_rank=R).
- `--beam-width W`: beam search (each engine's `LLM.beam_search`) over the workload's prompts,
  every prompt with `--beam-max-tokens` and ignore_eos; output tokens count the best beam's.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from minivllm.bench.procedures import GenResult

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_api_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-loras", type=int, default=0, help="dummy LoRA adapters spread over the requests")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--beam-width", type=int, default=0, help="beam search of this width instead of sampling")
    p.add_argument("--beam-max-tokens", type=int, default=128, help="beam search: max_tokens of every prompt")


def lora_engine_kwargs(args) -> dict:
    if not getattr(args, "num_loras", 0):
        return {}
    return {"enable_lora": True, "max_loras": args.num_loras, "max_lora_rank": args.lora_rank}


def variant_name(args) -> str:
    parts = []
    if getattr(args, "num_loras", 0):
        parts.append(f"{args.num_loras} LoRA adapters of rank {args.lora_rank}")
    if getattr(args, "beam_width", 0):
        parts.append(f"beam search width {args.beam_width}, max_tokens {args.beam_max_tokens}")
    return ", ".join(parts)


def workload(wl, args):
    """Beam search: every request gets beam_max_tokens (one BeamSearchParams for all, as vLLM's API takes)."""
    if not getattr(args, "beam_width", 0):
        return wl
    n = args.beam_max_tokens
    return replace(wl, name=f"{wl.name}-beam{args.beam_width}", params=[dict(p, max_tokens=n) for p in wl.params],
                   expected_output_tokens=n * len(wl.prompts))


def attach(adapter, args, model_dir: str) -> None:
    """Gives the adapter its LoRA directories and beam width (read by its generate)."""
    adapter.beam_width = getattr(args, "beam_width", 0)
    adapter.beam_max_tokens = getattr(args, "beam_max_tokens", 0)
    adapter.lora_paths = []
    if getattr(args, "num_loras", 0):
        adapter.lora_paths = write_dummy_adapters(model_dir, args.num_loras, args.lora_rank)


def write_dummy_adapters(model_dir: str, n: int, rank: int) -> list[str]:
    import torch
    from safetensors.torch import save_file
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    inter = cfg["intermediate_size"]
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    paths = []
    for a in range(n):
        g = torch.Generator().manual_seed(a)
        tensors = {}
        for layer in range(layers):
            for mod, (d_in, d_out) in dims.items():
                part = "self_attn" if mod in MODULES[:4] else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{mod}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, d_in, generator=g) / d_in ** 0.5).half()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(d_out, rank, generator=g) * 0.01).half()
        path = os.path.join(model_dir, f"lora{a}")
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
                       "bias": "none"}, f)
        paths.append(path)
    return paths


def lora_list(adapter, make_request, num_prompts: int) -> list | None:
    """Request i's adapter: make_request(name, int_id, path) of adapter i mod N (None without adapters)."""
    paths = getattr(adapter, "lora_paths", None)
    if not paths:
        return None
    reqs = [make_request(f"lora{i}", i + 1, p) for i, p in enumerate(paths)]
    return [reqs[i % len(reqs)] for i in range(num_prompts)]


def beam_results(outs, prompts: list[dict]) -> list[GenResult]:
    """Each prompt's best beam: its generated tokens (tokens hold prompt + output in both engines)."""
    res = []
    for o, p in zip(outs, prompts):
        n_prompt = len(p["prompt_token_ids"])
        res.append(GenResult(len(o.sequences[0].tokens) - n_prompt, n_prompt, None, None))
    return res
