"""The model-level wiring of the W4 layer tail (kernels/w4_layer_tail.py) on the CPU: a torch
stand-in with the tail's interface and the unfused path's math is attached where the runner
attaches the CUDA tails, and one-token steps must then give the same tokens as without it, through
CausalLM.forward_tails (chained through each next layer's qkv) and through DecoderLayer's own tail.
The CUDA kernel itself: tests/gpu/test_w4_layer_tail.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.bench import model_dirs
from minivllm.runner.model_runner import ModelRunner


class TorchTail(nn.Module):
    """W4LayerTail's contract in plain modules: forward(attn, residual[, next_tail])."""

    def __init__(self, layer: nn.Module, calls: list) -> None:
        super().__init__()
        object.__setattr__(self, "layer", layer)  # held, not registered: the layer owns its modules
        self.calls = calls

    def forward(self, attn, residual, next_tail=None):
        layer = self.layer
        assert attn.shape == (1, layer.self_attn.q_size)
        self.calls.append(next_tail is not None)
        hidden, res1 = layer.post_attention_layernorm(layer.self_attn.o_proj(attn), residual)
        out = layer.mlp(hidden)
        if next_tail is None:
            return out, res1
        nxt = next_tail.layer
        hidden, res2 = nxt.input_layernorm(out, res1)
        return nxt.self_attn.qkv_proj(hidden), res2


def _generate(monkeypatch, mode: str, calls: list) -> list[int]:
    """Greedy tokens of the tiny dummy Llama on the CPU; mode: off, layer (each DecoderLayer its own
    tail) or chain (CausalLM.forward_tails)."""
    def attach(self, model):  # in place of the CPU fast path: the plain forward, with tails
        if mode == "off":
            return
        for layer in model.layers:
            object.__setattr__(layer, "tail", TorchTail(layer, calls))
        model.tail_chain = mode == "chain"
    monkeypatch.setattr(ModelRunner, "setup_cpu_model", attach)
    llm = LLM(model=model_dirs.write_model_dir("tiny-llama"), load_format="dummy", skip_tokenizer_init=True,
              device="cpu", dtype="float32", max_model_len=256, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": list(range(3, 40))}], params)[0].outputs[0].token_ids
    llm.llm_engine.shutdown()
    return list(out)


@pytest.mark.parametrize("mode", ["layer", "chain"])
def test_one_token_steps_through_the_tails_give_the_same_tokens(monkeypatch, mode: str) -> None:
    calls: list = []
    ref = _generate(monkeypatch, "off", [])
    got = _generate(monkeypatch, mode, calls)
    assert got == ref and len(got) == 10
    layers = model_dirs.load_config("tiny-llama")["num_hidden_layers"]
    # the 9 decode steps took the tails (the prompt's step the unfused path); chained, every
    # layer but the last also ran the next layer's qkv
    assert len(calls) == 9 * layers
    assert sum(calls) == (9 * (layers - 1) if mode == "chain" else 0)
