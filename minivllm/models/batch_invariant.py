"""Batch-invariant mode: a request's result has the same bits whatever else runs in its step.

`LLM(batch_invariant=True)`, `--batch-invariant`, or vLLM's switch `VLLM_BATCH_INVARIANT=1`.
A floating-point reduction gives the same bits only in the same order, so every op on the
request's path must reduce each row in an order fixed by that row alone:

- matmuls: on the GPU the Triton kernel of kernels/invariant_gemm.py replaces cuBLAS for every
  linear layer, LM head included: K is cut in slices fixed per weight and each slice walked in
  order; the tile may follow the row count (a kept table), since every launch gives the same bits; on the CPU minivllm's panel kernel (one column's sum
  over K in one fixed order at every row count; models/cpu_linear.py), forced on whatever the
  CPU vendor (oneDNN and MKL pick their blocking by shape).
- attention: every query row reduces over its keys from key 0 in fixed tiles. GPU: all rows,
  decodes included, through the prefill kernel with one fixed tile (the decode kernel's KV
  split depends on the batch); CPU: the compiled kernel, one task per (sequence, KV head).
  Either way chunk boundaries and prefix-cache hits do not move a key tile boundary.
- RMSNorm, rotary, SiLU: one row at a time already (kernels/fused_ops.py, the CPU fused ops).
- sampling: log-softmax per row; an unseeded random request gets a seed of its own at admission
  (from the engine seed and its request id), so its noise is the counter-based per-row stream of
  sample/rng.py, not a slice of a batch-wide draw (on the GPU in one pass per row,
  kernels/seeded_race.py: W1-bi 12.6k -> 15.5k tok/s against the torch form, lease 23).

What it does not cover (refused at startup, engine/config_builder.py): quantized weights, MoE
layers, FP8 KV caches and speculative decoding. Default mode keeps its speed.
"""

from __future__ import annotations

import hashlib
import os

import torch
from torch import nn

ENV_FLAG = "VLLM_BATCH_INVARIANT"  # vLLM's switch, honoured as is


def batch_invariant_from_env() -> bool:
    return os.environ.get(ENV_FLAG, "0").strip().lower() in ("1", "true", "yes", "on")


def request_seed(engine_seed: int, request_id: str) -> int:
    """A per-request seed for an unseeded random request (stable across preemption: the request
    id does not change). int64 range."""
    digest = hashlib.blake2b(f"{engine_seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class InvariantLinear(nn.Module):
    """nn.Linear through the batch-invariant Triton matmul (the same weight Parameter: tied
    weights stay tied)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from minivllm.kernels.invariant_gemm import invariant_matmul
        return invariant_matmul(x, self.weight, self.bias)


def make_linears_batch_invariant(model: nn.Module) -> int:
    """Replace every CUDA nn.Linear of `model` by an InvariantLinear; returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.device.type == "cuda"]
    for parent, name, child in targets:
        setattr(parent, name, InvariantLinear(child))
    return len(targets)


def unsupported_reason(device: str, dtype: str, quantized: bool, moe: bool, kv_cache_dtype: str,
                       speculative: bool) -> str | None:
    """Why batch-invariant mode cannot run with these settings (None: it can)."""
    if quantized:
        return "quantized weights (their GEMM kernels pick tiles by shape)"
    if moe:
        return "MoE models (the fused-MoE kernel picks tiles by the number of tokens)"
    if kv_cache_dtype == "fp8":
        return "an FP8 KV cache"
    if speculative:
        return "speculative decoding"
    if device == "cpu" and dtype != "float32":
        return f"dtype {dtype} on the CPU (the invariant CPU kernels are float32)"
    return None
