"""Batch-invariant mode on the CPU (models/batch_invariant.py), default model, fp32: one prompt's
token ids and logprobs are bitwise the same alone, at every position of a batch of 16, with
chunked prefill, and after a prefix-cache hit; a seeded random sample too.

Without the mode at least one of those differs: the comparison engine runs the linears on oneDNN
(MINIVLLM_CPU_LINEAR_KERNEL=0, the default on Intel CPUs), which blocks a matmul by its row
count. (On AMD CPUs the default path is minivllm's panel kernel, invariant already; the mode then
guarantees it rather than changing it.) If this comparison ever finds no difference, the checks
above prove nothing, so it is asserted."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. The message is "
          "from someone who lived in the same lighthouse a hundred years ago, and it says")
OTHERS = [("tell me " * (3 + 5 * i)) + f"about the number {i}" for i in range(15)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=8, logprobs=5)


def _signature(out) -> tuple:
    """token ids and every logprob value (floats compared exactly) of a request's only sample."""
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in c.logprobs)


def _runs(llm: LLM, params: SamplingParams, positions: range) -> dict[str, tuple]:
    """PROMPT's signature alone and at each position of a 16-prompt batch."""
    runs = {"alone": _signature(llm.generate([PROMPT], params, use_tqdm=False)[0])}
    for i in positions:
        batch = OTHERS[:i] + [PROMPT] + OTHERS[i:]
        runs[f"position {i}"] = _signature(llm.generate(batch, params, use_tqdm=False)[i])
    return runs


def _differences(runs: dict[str, tuple]) -> list[str]:
    base = runs["alone"]
    return [name for name, sig in runs.items() if sig != base]


@pytest.fixture(scope="module")
def invariant_llm():
    return LLM(batch_invariant=True, enable_prefix_caching=False, max_model_len=512)


def test_same_bits_alone_and_at_every_batch_position(invariant_llm):
    runs = _runs(invariant_llm, GREEDY, range(16))
    assert _differences(runs) == []
    assert len(runs["alone"][0]) == 8


def test_seeded_sample_same_bits_in_a_batch(invariant_llm):
    assert _differences(_runs(invariant_llm, SEEDED, range(0, 16, 5))) == []


def test_same_bits_with_chunked_prefill_and_prefix_hits(invariant_llm):
    base = _signature(invariant_llm.generate([PROMPT], GREEDY, use_tqdm=False)[0])
    chunked = LLM(batch_invariant=True, enable_prefix_caching=True, max_model_len=512, max_num_batched_tokens=16)
    cold = _signature(chunked.generate([PROMPT], GREEDY, use_tqdm=False)[0])  # prompt in 16-token chunks
    stats = chunked.llm_engine.get_stats()
    hit = _signature(chunked.generate([PROMPT], GREEDY, use_tqdm=False)[0])  # its full blocks cached
    assert chunked.llm_engine.get_stats().prefix_cache_hits > stats.prefix_cache_hits  # the hit happened
    batched = _signature(chunked.generate(OTHERS[:7] + [PROMPT] + OTHERS[7:], GREEDY, use_tqdm=False)[7])
    assert cold == base and hit == base and batched == base


def test_without_the_mode_something_differs(monkeypatch):
    """The control: the same checks on a path that is not batch invariant find a difference."""
    monkeypatch.setenv("MINIVLLM_CPU_LINEAR_KERNEL", "0")
    llm = LLM(enable_prefix_caching=False, max_model_len=512)
    runs = _runs(llm, GREEDY, range(16))
    assert _differences(runs), "no difference without batch invariance: the invariant checks prove nothing"


def test_bad_combinations_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="batch_invariant.*speculative"):
        LLM(batch_invariant=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="batch_invariant.*FP8 KV"):
        LLM(batch_invariant=True, kv_cache_dtype="fp8")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # vLLM's switch turns the mode on too
    with pytest.raises(ValueError, match="batch_invariant.*bfloat16"):
        LLM(dtype="bfloat16")
