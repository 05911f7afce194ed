"""The W5 floors of `bench cpu` (bench/cpu_floor.py): K/V bytes read by decode, and the timed
linear-only schedule on a tiny model."""

from __future__ import annotations

import types

import torch

from minivllm.bench.cpu_floor import kv_read_bytes, linear_floor


def test_kv_read_bytes_counts_every_decode_step():
    model = types.SimpleNamespace(cfg=types.SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=8))
    prompts, max_tokens = [5, 9], 4
    per_key = 3 * 2 * 2 * 8 * 4  # layers x (K, V) x heads x dim x float32
    # decode step j of a prompt of p tokens attends over p + j keys (j = 1 .. max_tokens - 1)
    expected = sum((p + j) * per_key for p in prompts for j in range(1, max_tokens))
    assert kv_read_bytes(model, prompts, max_tokens) == expected


def test_linear_floor_follows_the_schedule():
    from minivllm.attention.torch_backend import TorchAttentionBackend
    from minivllm.models.arch import ArchConfig
    from minivllm.models.llama import CausalLM
    cfg = ArchConfig("LlamaForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=256, tie_word_embeddings=True, attention_bias=False, qk_norm=False)
    model = CausalLM(cfg, TorchAttentionBackend(), 256).eval()
    out = linear_floor(model, [30, 50, 20], max_tokens=5, step_budget=64, decode_reps=2)
    assert out["prefill_steps"] == [64, 36]  # 100 prompt tokens in chunks of the step budget
    assert out["decode_steps"] == 4
    assert set(out["decode_step_ms"]) >= {"engine", "f_linear"}
    best = min(out["decode_step_ms"].values()) / 1e3
    assert abs(out["floor_s"] - (out["prefill_s"] + 4 * best)) < 1e-9
    assert out["ceiling_tok_per_s"] == 3 * 5 / out["floor_s"]
    layer_params = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 2 * 96 + 96 * 64  # qkv, o, gate_up, down
    flops = 2 * 2 * layer_params * (100 + 4 * 3) + 2 * 64 * 97 * 3 * 5
    assert abs(out["linear_tflop"] - flops / 1e12) < 1e-15
    assert not torch.is_inference_mode_enabled()  # the timing ran under its own inference mode
