"""Speculative sampling leaves the output distribution the target's: on a tiny random model with
an 8-token vocabulary, the tokens sampled after the first (the ones speculation decides) over
thousands of seeds have the same distribution with and without speculation (two-sample
chi-square, p > 0.01), with a deliberately bad draft model (another random model) and with the
target's own first layer drafting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from minivllm import LLM, SamplingParams

VOCAB, N = 8, 3000


def _tiny_model(path, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # peaked, varied distributions instead of near-uniform ones
    model.save_pretrained(path)
    return str(path)


def _sample(model_dir: str, spec: dict | None) -> np.ndarray:
    if spec is not None:  # 256 rows a step: speculate in every one of them
        spec = dict(spec, disable_by_batch_size=None)
    llm = LLM(model_dir, dtype="float32", device="cpu", skip_tokenizer_init=True, max_num_seqs=256,
              max_model_len=64, speculative_config=spec)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": [2, 3, 4]}] * N, params, use_tqdm=False)
    if spec is not None:
        assert llm.llm_engine.scheduler.spec_stats.num_draft_tokens >= 2 * N  # speculation really ran
    return np.array([o.outputs[0].token_ids for o in outs])  # [N, 4]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _tiny_model(tmp_path_factory.mktemp("target"), 0), _tiny_model(tmp_path_factory.mktemp("draft"), 1)


@pytest.fixture(scope="module")
def plain(models):
    return _sample(models[0], None)


@pytest.mark.parametrize("kind", ["bad_draft_model", "layer_skip"])
def test_speculative_sampling_keeps_the_distribution(models, plain, kind):
    target, draft = models
    spec = ({"model": draft, "num_speculative_tokens": 2} if kind == "bad_draft_model"
            else {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2})
    got = _sample(target, spec)
    for pos in (1, 2, 3):
        table = np.stack([np.bincount(plain[:, pos], minlength=VOCAB), np.bincount(got[:, pos], minlength=VOCAB)])
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table).pvalue > 0.01, (pos, table)
    # and the pairs (token 1, token 2): the joint law of the speculated tokens
    pair = lambda a: a[:, 1] * VOCAB + a[:, 2]  # noqa: E731
    table = np.stack([np.bincount(pair(plain), minlength=VOCAB ** 2), np.bincount(pair(got), minlength=VOCAB ** 2)])
    table = table[:, table.sum(0) >= 10]
    assert chi2_contingency(table).pvalue > 0.01
