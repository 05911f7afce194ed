"""The model-level wiring of the W4 layer tail (kernels/w4_layer_tail.py) on the CPU: a torch
stand-in with the tail's interface and the unfused path's math is attached where the runner
attaches the CUDA tails, and one-token steps must then give the same tokens as without it, through
CausalLM.forward_tails (chained through each next layer's qkv) and through DecoderLayer's own tail.
The CUDA kernel itself: tests/gpu/test_w4_layer_tail.py."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.bench import model_dirs
from minivllm.runner.model_runner import ModelRunner


class TorchTail(nn.Module):
    """W4LayerTail's contract in plain modules: forward(attn, residual[, next_tail[, rope]]) and
    rope_target (here on the CPU too, unless `rope` is off)."""

    def __init__(self, layer: nn.Module, calls: list, rope: bool) -> None:
        super().__init__()
        object.__setattr__(self, "layer", layer)  # held, not registered: the layer owns its modules
        self.calls, self.rope = calls, rope

    def rope_target(self, attention, positions, slot_mapping):
        return types.SimpleNamespace(positions=positions, slot_mapping=slot_mapping) if self.rope else None

    def forward(self, attn, residual, next_tail=None, rope=None):
        layer = self.layer
        assert attn.shape == (1, layer.self_attn.q_size)
        self.calls.append((next_tail is not None, rope is not None))
        hidden, res1 = layer.post_attention_layernorm(layer.self_attn.o_proj(attn), residual)
        out = layer.mlp(hidden)
        if next_tail is None:
            return out, res1
        nxt = next_tail.layer
        hidden, res2 = nxt.input_layernorm(out, res1)
        qkv = nxt.self_attn.qkv_proj(hidden)
        if rope is not None:  # the kernel's OUT_QKV epilogue: q rotated in qkv, rotated K and V cached
            a = nxt.self_attn
            q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            q, k = a.rotary(rope.positions, q.reshape(1, a.num_heads, a.head_dim),
                            k.reshape(1, a.num_kv_heads, a.head_dim))
            a.backend.store_kv(k, v.reshape(1, a.num_kv_heads, a.head_dim), a.k_cache, a.v_cache,
                               rope.slot_mapping)
            qkv = torch.cat([q.reshape(1, -1), qkv[:, a.q_size:]], dim=-1)
        return qkv, res2


def _generate(monkeypatch, mode: str, calls: list) -> tuple[list[int], list[float]]:
    """Greedy tokens of the tiny dummy Llama on the CPU and their logprobs; mode: off, layer (each DecoderLayer its own
    tail), chain (CausalLM.forward_tails, the next layer's rotary and K/V store in the tail) or
    chain-norope (forward_tails, each attention's own rotary and store)."""
    def attach(self, model):  # in place of the CPU fast path: the plain forward, with tails
        if mode == "off":
            return
        for layer in model.layers:
            object.__setattr__(layer, "tail", TorchTail(layer, calls, rope=mode == "chain"))
        model.tail_chain = mode.startswith("chain")
    monkeypatch.setattr(ModelRunner, "setup_cpu_model", attach)
    llm = LLM(model=model_dirs.write_model_dir("tiny-llama"), load_format="dummy", skip_tokenizer_init=True,
              device="cpu", dtype="float32", max_model_len=256, seed=0)
    # the logprobs too: the dummy model's attention barely moves its tokens (a q rotated twice left
    # them all equal; its logprobs moved by ~1e-4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    out = llm.generate([{"prompt_token_ids": list(range(3, 40))}], params)[0].outputs[0]
    llm.llm_engine.shutdown()
    return list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


@pytest.mark.parametrize("mode", ["layer", "chain", "chain-norope"])
def test_one_token_steps_through_the_tails_give_the_same_tokens(monkeypatch, mode: str) -> None:
    calls: list = []
    ref, ref_logprobs = _generate(monkeypatch, "off", [])
    got, logprobs = _generate(monkeypatch, mode, calls)
    assert got == ref and len(got) == 10
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-6, rel=0)
    layers = model_dirs.load_config("tiny-llama")["num_hidden_layers"]
    # the 9 decode steps took the tails (the prompt's step the unfused path); chained, every
    # layer but the last also ran the next layer's qkv (and, with rope, its rotary and K/V store)
    assert len(calls) == 9 * layers
    chained = 9 * (layers - 1) if mode.startswith("chain") else 0
    assert sum(nxt for nxt, _ in calls) == chained
    assert sum(rope for _, rope in calls) == (chained if mode == "chain" else 0)
