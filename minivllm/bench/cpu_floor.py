"""What W5's linear layers alone cost on this CPU, measured in the same run as the benchmark.

W5's arithmetic is almost all matrix products: ~0.76 TFLOP of prefill linears and ~1.1 TFLOP of
decode linears (lm_head included), against ~0.07 TFLOP of attention. Timing the model's own
linear layers over W5's schedule, with nothing else (no attention, norms, sampling or engine),
gives a floor on the batch time and so a ceiling on output tok/s that no engine work can pass
with these matrix-product kernels. The decode shape is also timed with MKL's packed GEMM for
exactly that row count, with plain `F.linear` and (when the engine runs minivllm's own panel
kernel) with oneDNN's packed weights, and the floor takes the fastest.

Decode attention adds a second floor: every decode step reads the K/V of every running
sequence's context in every layer (float32), which takes at least those bytes over the memory
read bandwidth measured in the same run (`kv_read_bytes`; prefill attention is left out).

Schedule: the prompts' tokens in chunks of the step budget (the engine's prefill steps), the
lm_head once over one row per request, then (max_tokens - 1) decode steps of one row per
request; a sample of decode steps is timed and scaled.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def kv_read_bytes(model, prompt_lens: list[int], max_tokens: int) -> int:
    """Bytes of K/V that W5's decode steps read: step j (1 .. max_tokens - 1) of a request with
    prompt length p attends over p + j keys, in every layer, K and V, float32."""
    cfg = model.cfg
    per_key = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    keys = sum(p * (max_tokens - 1) + (max_tokens - 1) * max_tokens // 2 for p in prompt_lens)
    return keys * per_key


def _decoder_linears(model) -> list:
    """The model's linear layers in forward order, as the engine calls them (bound forwards)."""
    out = []
    for layer in model.layers:
        out += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return out


def _time_chain(calls, inputs: dict[int, torch.Tensor], reps: int) -> float:
    """Median seconds of one pass over `calls` ((in_features, fn) pairs)."""
    times = []
    for _ in range(reps + 1):  # the first pass warms up allocator and library state
        t = time.perf_counter()
        for k, fn in calls:
            fn(inputs[k])
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


@torch.inference_mode()
def linear_floor(model, prompt_lens: list[int], max_tokens: int, step_budget: int, decode_reps: int = 6) -> dict:
    layers = _decoder_linears(model)
    head = model.lm_head
    every = layers + [head]
    dims = {m.in_features for m in every}
    # prefill: the decoder linears over each step's tokens, then the lm_head on one row a request
    total = sum(prompt_lens)
    chunks = [min(step_budget, total - s) for s in range(0, total, step_budget)]
    prefill_s = 0.0
    for m in chunks:
        x = {k: torch.randn(m, k) for k in dims}
        prefill_s += _time_chain([(l.in_features, l.forward) for l in layers], x, 1)
    rows = len(prompt_lens)
    x = {k: torch.randn(rows, k) for k in dims}
    prefill_s += _time_chain([(head.in_features, head.forward)], x, 3)
    # decode: every linear at `rows` rows, three ways
    decode = {"engine": _time_chain([(l.in_features, l.forward) for l in every], x, decode_reps),
              "f_linear": _time_chain([(l.in_features, lambda v, w=l.weight: F.linear(v, w)) for l in every], x,
                                      decode_reps)}
    try:
        packed = [(l.in_features, l.weight, torch.ops.mkl._mkl_reorder_linear_weight(l.weight, rows)) for l in every]
        decode["mkl_packed"] = _time_chain(
            [(k, lambda v, w=w, p=p: torch.ops.mkl._mkl_linear(v, p, w, None, rows)) for k, w, p in packed], x,
            decode_reps)
        del packed
    except (RuntimeError, AttributeError):  # a torch without MKL
        pass
    if torch.backends.mkldnn.is_available() and getattr(layers[0], "panels", None) is not None:
        # the engine runs minivllm's panel kernel: time oneDNN's packing too, for the record
        packed = [(l.in_features, torch.ops.mkldnn._reorder_linear_weight(l.weight, None)) for l in every]
        decode["onednn_packed"] = _time_chain(
            [(k, lambda v, p=p: torch.ops.mkldnn._linear_pointwise(v, p, None, "none", [], "")) for k, p in packed],
            x, decode_reps)
        del packed
    best = min(decode.values())
    floor_s = prefill_s + (max_tokens - 1) * best
    flops = 2 * sum(m.in_features * m.out_features for m in layers) * (total + (max_tokens - 1) * rows) \
        + 2 * head.in_features * head.out_features * rows * max_tokens
    return {"kv_read_bytes": kv_read_bytes(model, prompt_lens, max_tokens), "prefill_s": prefill_s, "prefill_steps": chunks,
            "decode_step_ms": {k: 1e3 * v for k, v in decode.items()}, "decode_steps": max_tokens - 1,
            "floor_s": floor_s, "ceiling_tok_per_s": rows * max_tokens / floor_s,
            "linear_tflop": flops / 1e12, "gflop_per_s_at_floor": flops / floor_s / 1e9}
