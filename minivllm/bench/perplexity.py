"""`minivllm bench perplexity`: perplexity of the bundled SmolLM2-135M on a fixed text
(bench/data/perplexity_text.txt), through minivllm's own model code on the CPU in float32, for the
unquantized weights and each quantized form: the quality cost of the formats (docs/perf.md,
quantization).

    minivllm bench perplexity [--quant-dir DIR] [--variants fp32,awq,...]

DIR: scripts/quantize_default_model.py's output (written to a temporary directory if not given).
Each variant runs the whole text as one sequence of at most --max-tokens tokens: one forward pass
over a paged KV cache (the cache is written first and read back, so an FP8 cache counts).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import torch

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "perplexity_text.txt")
# variant -> (checkpoint sub-directory or None for the bundled GGUF, LLM keyword arguments)
VARIANTS = {
    "fp32": (None, {}),
    "fp8-kv": (None, {"kv_cache_dtype": "fp8"}),
    "fp8-kv-calibrated": (None, {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}),
    "fp8-online": (None, {"quantization": "fp8"}),
    "ct-fp8": ("ct-fp8", {}),
    "fp8": ("fp8", {}),
    "awq": ("awq", {}),
    "gptq": ("gptq", {}),
    "gptq-asym": ("gptq-asym", {}),
    "gptq-act": ("gptq-act", {}),
    "ct-w4a16": ("ct-w4a16", {}),
}


@torch.inference_mode()
def perplexity(model_dir: str | None, token_ids: list[int], **kw) -> float:
    from minivllm.attention.backend import get_attention_backend
    from minivllm.engine.config_builder import build_engine_config
    from minivllm.models.loader import build_model
    from minivllm.runner.kv_cache import allocate_kv_cache
    cfg = build_engine_config(model_dir, device="cpu", dtype="float32", **kw)
    model = build_model(cfg.model, get_attention_backend("torch"), torch.device("cpu"), torch.float32)
    kv_dtype = torch.float8_e4m3fn if cfg.cache.kv_cache_dtype == "fp8" else torch.float32
    t, bs = len(token_ids), 16
    caches = allocate_kv_cache(cfg.model.arch, -(-t // bs), bs, kv_dtype, torch.device("cpu"))
    for layer, (k, v) in zip(model.layers, caches):
        layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
        layer.self_attn.calibrate_kv = cfg.cache.calculate_kv_scales  # scales from this text's K/V, as the runner
    hidden = model(torch.tensor(token_ids), torch.arange(t), _one_sequence(t, bs))
    logits = model.compute_logits(hidden[:-1]).float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(token_ids[1:]))
    return math.exp(nll.item())


def _one_sequence(t: int, block_size: int):
    from minivllm.attention.metadata import AttentionMetadata
    i32 = torch.int32
    return AttentionMetadata(torch.arange(t), torch.tensor([0, t], dtype=i32), torch.tensor([t], dtype=i32),
                             torch.arange(-(-t // block_size), dtype=i32).view(1, -1), t, t, [0, t], [t])


def cmd_perplexity(args) -> int:
    from transformers import AutoTokenizer

    from minivllm.models.source import default_gguf_path
    gguf = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    with open(TEXT) as f:
        ids = tok(f.read())["input_ids"][: args.max_tokens]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    quant_dir = args.quant_dir
    needed = sorted({VARIANTS[v][0] for v in variants if VARIANTS[v][0]})
    if needed and quant_dir is None:
        from minivllm.quant.export import write_all
        quant_dir = tempfile.mkdtemp(prefix="minivllm-quant-")
        write_all(gguf, quant_dir, tuple(needed), 64)
    print(f"{len(ids)} tokens of bench/data/perplexity_text.txt")
    for v in variants:
        sub, kw = VARIANTS[v]
        t0 = time.time()
        ppl = perplexity(os.path.join(quant_dir, sub) if sub else None, ids, **kw)
        print(f"{v:12s} perplexity {ppl:8.3f}   ({time.time() - t0:.0f} s)", flush=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of the default model, unquantized and in each quantized "
                                          "format (CPU, fp32)")
    p.add_argument("--quant-dir", default=None, help="scripts/quantize_default_model.py's output (default: "
                                                     "written to a temporary directory)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--max-tokens", type=int, default=1024)
    p.set_defaults(bench_func=cmd_perplexity)
