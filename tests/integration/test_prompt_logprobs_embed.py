"""Prompt logprobs and embeddings against Hugging Face on the same weights, fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, PoolingParams, SamplingParams
from minivllm.runner import extra_outputs

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of",
           " ".join(f"word{i}" for i in range(60))]  # ~120 tokens: several prefill chunks below
K = 3


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tok = llm.get_tokenizer()
    return [tok(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_logprobs(hf_model, prompt_ids):
    with torch.no_grad():
        return [torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1) for ids in prompt_ids]


def _check(out, ids, ref):
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        entry = plp[pos]
        want = ref[pos - 1]
        assert abs(entry[ids[pos]].logprob - want[ids[pos]].item()) < 1e-4, f"position {pos}"
        assert entry[ids[pos]].rank == int((want >= want[ids[pos]]).sum())
        top = want.topk(K).indices.tolist()
        assert set(top) <= set(entry), f"position {pos}: top-{K} {top} not in {list(entry)}"
        for t in top:
            assert abs(entry[t].logprob - want[t].item()) < 1e-4


def test_prompt_logprobs_equal_hf(llm, prompt_ids, hf_logprobs):
    params = SamplingParams(max_tokens=1, prompt_logprobs=K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    for out, ids, ref in zip(outs, prompt_ids, hf_logprobs):
        _check(out, ids, ref)
    # again: the prompts are now in the prefix cache, yet every prompt position is computed
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    for out, ids, ref in zip(outs, prompt_ids, hf_logprobs):
        _check(out, ids, ref)


def test_prompt_logprobs_chunked_and_row_capped(monkeypatch, prompt_ids, hf_logprobs):
    """Prefill in chunks of 16 tokens and at most 7 LM-head rows per call: the same values."""
    monkeypatch.setattr(extra_outputs, "PROMPT_LOGPROBS_ROWS", 7)
    small = LLM(dtype="float32", device="cpu", max_num_batched_tokens=16, max_num_seqs=4)
    outs = small.generate([{"prompt_token_ids": p} for p in prompt_ids],
                          SamplingParams(max_tokens=2, prompt_logprobs=K), use_tqdm=False)
    assert max(len(p) for p in prompt_ids) > 16
    for out, ids, ref in zip(outs, prompt_ids, hf_logprobs):
        _check(out, ids, ref)
        assert len(out.outputs[0].token_ids) == 2


def test_prompt_logprobs_limit(llm):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_embeddings_equal_pooled_hf(pooling, llm, hf_model, prompt_ids):
    outs = llm.embed([{"prompt_token_ids": p} for p in prompt_ids], PoolingParams(pooling_type=pooling),
                     use_tqdm=False)
    with torch.no_grad():
        for out, ids in zip(outs, prompt_ids):
            hidden = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]  # after the norm
            ref = hidden[-1] if pooling == "LAST" else hidden.mean(0)
            ref = torch.nn.functional.normalize(ref, dim=-1)
            got = torch.tensor(out.outputs.embedding)
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() < 1e-4


def test_embeddings_unnormalized_and_bad_dimensions(llm):
    a = llm.embed(["hello there"], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    b = llm.embed(["hello there"], use_tqdm=False)[0].outputs.embedding
    norm = sum(x * x for x in a) ** 0.5
    assert norm > 1.5 and abs(sum(x * x for x in b) - 1.0) < 1e-5
    assert max(abs(x / norm - y) for x, y in zip(a, b)) < 1e-5
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(["hi"], PoolingParams(dimensions=7), use_tqdm=False)
