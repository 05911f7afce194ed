"""Mixture-of-experts models against Hugging Face transformers, fp32 on the CPU: tiny random
Qwen3-MoE, Mixtral and Qwen2-MoE models saved with save_pretrained (and written as GGUF):
greedy tokens equal token for token, log-probabilities close; bad checkpoints fail clearly."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_moe import PROMPTS, build, hf_greedy, hf_logprobs, write_gguf

from minivllm import LLM, SamplingParams

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", skip_tokenizer_init=True, **kw)


def _generate(llm: LLM, params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe"])
def hf_model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    model = build(request.param, path)
    return request.param, path, model, hf_greedy(model, PROMPTS, MAX_NEW)


def test_greedy_equals_hf(hf_model):
    kind, path, _, ref = hf_model
    llm = _llm(path)
    assert llm.llm_engine.config.model.arch.moe is not None
    got = [o.outputs[0].token_ids for o in _generate(llm)]
    assert got == ref, f"{kind}: minivllm {got} != HF {ref}"
    assert len({t for r in ref for t in r}) > 8, "the model should not repeat one token (a weak oracle)"


def test_logprobs_close_to_hf(hf_model):
    kind, path, model, ref = hf_model
    outs = _generate(_llm(path), SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3))
    for prompt, out, cont in zip(PROMPTS, outs, ref):
        hf = hf_logprobs(model, prompt, cont)  # [MAX_NEW, V]
        for step, lp in enumerate(out.outputs[0].logprobs):
            for tok, got in lp.items():
                want = hf[step, tok].item()
                assert abs(got.logprob - want) < 1e-4, f"{kind} step {step} token {tok}: {got.logprob} vs HF {want}"


def test_chunked_prefill_and_expert_counts(hf_model):
    """Prompts split into 8-token chunks give the same tokens; the per-expert counters hold
    one count per token, sparse layer and selected expert."""
    kind, path, model, ref = hf_model
    llm = _llm(path, max_num_batched_tokens=8, enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in _generate(llm)]
    assert got == ref
    runner = llm.llm_engine.executor.runner
    per_layer = runner.expert_counts.per_layer()
    moe = llm.llm_engine.config.model.arch.moe
    tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (MAX_NEW - 1)  # the last token is never fed
    sparse = [i for i in range(model.config.num_hidden_layers) if moe.is_sparse_layer(i)]
    assert len(per_layer) == len(sparse) and all(len(r) == moe.num_experts for r in per_layer)
    assert all(sum(r) == tokens * moe.top_k for r in per_layer), per_layer
    runner.expert_counts.poll(force=True)
    stats = llm.llm_engine.get_stats().expert_token_counts
    assert list(stats) == [sum(c) for c in zip(*per_layer)]


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_gguf_equals_hf(kind, tmp_path):
    model = build(kind, seed=1)
    path = str(tmp_path / f"{kind}.gguf")
    write_gguf(model, kind, path)
    got = [o.outputs[0].token_ids for o in _generate(_llm(path))]
    assert got == hf_greedy(model, PROMPTS, MAX_NEW)


def test_dummy_weights_from_moe_config():
    """load_format=dummy on a bundled MoE shape (tiny-qwen3-moe: the qwen3-30b-a3b config scaled
    down) runs, and the router spreads tokens over many experts."""
    from minivllm.bench.model_dirs import write_model_dir
    llm = _llm(write_model_dir("tiny-qwen3-moe"), load_format="dummy")
    outs = _generate(llm, SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    counts = llm.llm_engine.executor.runner.expert_counts.per_layer()
    assert sum(1 for c in counts[0] if c) > len(counts[0]) // 4


# ---- bad checkpoints ------------------------------------------------------------------------------------
def _edit_config(path: str, **changes) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("kind,changes,match", [
    # the checkpoint has 8 experts: a config of 4 finds expert 4..7's tensors (or a [8, H] router)
    ("qwen3_moe", {"num_local_experts": 4, "num_experts": 4}, r"mlp\.(gate|experts\.\d+\.\w+)\.weight'"),
    # more experts in the config than in the checkpoint: the router's shape disagrees
    ("mixtral", {"num_local_experts": 6}, r"block_sparse_moe\.gate\.weight' has shape \(4, 64\), expected \(6, 64\)"),
    # narrower experts in the config than in the checkpoint
    ("qwen3_moe", {"moe_intermediate_size": 16}, r"experts\.\d+\.(gate|up|down)_proj\.weight' has shape"),
    ("qwen2_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok must be in \[1, num_experts=8\], got 9"),
])
def test_checkpoint_disagreeing_with_config(kind, changes, match, tmp_path):
    path = str(tmp_path / kind)
    build(kind, path)
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=match):
        _llm(path)


def test_checkpoint_missing_an_expert(tmp_path):
    from safetensors.torch import load_file, save_file
    path = str(tmp_path / "mixtral")
    build("mixtral", path)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.2.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights for \['layers\.2\.mlp\.experts\.w13#3\.1'\]"):
        _llm(path)
