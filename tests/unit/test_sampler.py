"""Unit tests for the batched sampler (minivllm.sample), on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from minivllm.sample import (
    Sampler,
    SamplingBatch,
    SamplingRequestState,
    apply_top_k_top_p_min_p,
    process_logits,
    validate_for_vocab,
)
from minivllm.sample.rng import _generator_exponentials, exponential_race, seeded_exponentials, wrap_seed
from minivllm.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _state(prompt=(0,), output=(), eos=(), index=0, **kw) -> SamplingRequestState:
    return SamplingRequestState(SamplingParams(**kw), list(prompt), list(output), set(eos), index)


def _run(logits, states, generator=None):
    batch = SamplingBatch.build(states, logits.shape[1], logits.device, generator)
    return Sampler()(logits, batch)


def _kept(masked: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > NEG_INF).flatten().tolist() for row in masked]


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = _run(logits, [_state(temperature=0.0) for _ in range(16)])
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.logprobs is None


def test_greedy_rows_unaffected_by_other_rows():
    logits = torch.randn(6, 200, generator=torch.Generator().manual_seed(1))
    others = [
        _state(temperature=0.8, top_k=3, seed=7),
        _state(temperature=1.3, top_p=0.3, min_p=0.2),
        _state(temperature=1.0, frequency_penalty=2.0, output=[5, 6], logit_bias={9: 50.0}),
    ]
    greedy = [_state(temperature=0.0), _state(temperature=0.0, top_k=1, top_p=0.1, seed=3)]
    alone = _run(logits[[0, 3]], greedy).sampled_token_ids
    mixed = _run(logits, [greedy[0], *others[:2], greedy[1], others[2], _state()],
                 torch.Generator().manual_seed(0))
    assert torch.equal(alone, logits[[0, 3]].argmax(-1))
    assert torch.equal(mixed.sampled_token_ids[[0, 3]], alone)
    assert mixed.sampled_token_ids[4].item() == 9  # +50 bias dominates a randn row


# ---------------------------------------------------------------- top-k / top-p / min-p


def test_top_k_mask_keeps_exactly_k_and_ties():
    logits = torch.tensor([
        [1.0, 2.0, 3.0, 4.0, 5.0],
        [5.0, 4.0, 4.0, 1.0, 0.0],  # tie at the k-th value: both kept
        [0.0, 3.0, 3.0, 2.0, 1.0],
        [1.0, 2.0, 3.0, 4.0, 5.0],  # top_k 0 = off
        [1.0, 2.0, 3.0, 4.0, 5.0],  # k >= vocab keeps all
    ])
    top_k = torch.tensor([2, 2, 1, 0, 9])
    expected = [[3, 4], [0, 1, 2], [1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert _kept(apply_top_k_top_p_min_p(logits.clone(), top_k, None, None, max_top_k=2)) == expected
    # the sort path (taken when top_p is present) agrees with the topk path
    ones = torch.ones(5)
    assert _kept(apply_top_k_top_p_min_p(logits.clone(), top_k, ones, None)) == expected
    assert _kept(apply_top_k_top_p_min_p(logits.clone(), top_k, None, None)) == expected


def test_top_p_mask():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(5, 1)[:, [2, 0, 3, 1]]  # shuffled: token ids 1, 3, 0, 2 by prob
    top_p = torch.tensor([0.6, 0.85, 0.1, 1.0, 0.97])
    out = apply_top_k_top_p_min_p(logits.clone(), None, top_p, None)
    # masses before each token in prob order: 0, .5, .8, .95; keep while < p; >= 1 token
    assert _kept(out) == [[1, 3], [0, 1, 3], [1], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert torch.equal(out[out > NEG_INF], logits[out > NEG_INF])  # survivors unchanged


def test_top_p_ties_and_top_k_renormalisation():
    tied = torch.tensor([[0.4, 0.2, 0.2, 0.2]]).log()
    # the prefix needs token 1 (0.4 < 0.5); tokens 2 and 3 are tied with it and kept too
    assert _kept(apply_top_k_top_p_min_p(tied, None, torch.tensor([0.5]), None)) == [[0, 1, 2, 3]]
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().repeat(2, 1)
    # top-k 2 renormalises to (.625, .375): p = .6 then keeps only token 0 ...
    out = apply_top_k_top_p_min_p(logits.clone(), torch.tensor([2, 0]), torch.tensor([0.6, 0.6]),
                                  None)
    # ... while without top-k p = .6 keeps tokens 0 and 1
    assert _kept(out) == [[0], [0, 1]]


def test_min_p_mask_and_combination():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().repeat(4, 1)
    min_p = torch.tensor([0.25, 0.7, 0.0, 0.12])
    out = apply_top_k_top_p_min_p(logits.clone(), None, None, min_p)
    assert _kept(out) == [[0, 1, 2], [0], [0, 1, 2, 3], [0, 1, 2]]
    combined = apply_top_k_top_p_min_p(
        logits.clone(), torch.tensor([3, 0, 0, 2]), torch.tensor([1.0, 0.85, 1.0, 1.0]),
        torch.tensor([0.2, 0.4, 0.0, 0.0]))
    assert _kept(combined) == [[0, 1, 2], [0, 1], [0, 1, 2, 3], [0, 1]]


# ---------------------------------------------------------------- distributions

V_SMALL, N_DRAWS = 8, 20_000
_LOGITS = torch.randn(V_SMALL, generator=torch.Generator().manual_seed(5)) * 1.2


def _many(n: int, seeded: bool, **kw) -> list[SamplingRequestState]:
    """n samples of one request; seeded ones differ by sample_index (seed + i, as for n > 1)."""
    params = SamplingParams(seed=1000 if seeded else None, **kw)
    return [SamplingRequestState(params, [0], [], (), i) for i in range(n)]


def _check_distribution(tokens: torch.Tensor, expected_probs: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the support"
    f_exp = expected_probs[support].double()
    f_exp = f_exp / f_exp.sum() * counts.sum()
    p = stats.chisquare(counts[support].numpy(), f_exp.numpy()).pvalue
    assert p > 1e-3, (counts, f_exp, p)


@pytest.mark.parametrize("seeded", [True, False])
def test_temperature_distribution(seeded):
    temp = 0.7
    states = _many(N_DRAWS, seeded, temperature=temp)
    logits = _LOGITS.repeat(N_DRAWS, 1)
    out = _run(logits, states, torch.Generator().manual_seed(123))
    _check_distribution(out.sampled_token_ids, torch.softmax(_LOGITS / temp, -1))


def test_seeded_stream_over_counters_distribution():
    # one request (one seed) across 20k steps: the counter alone must decorrelate the draws
    probs = torch.softmax(_LOGITS / 1.5, -1).repeat(N_DRAWS, 1)
    seeds = torch.full((N_DRAWS,), 2024, dtype=torch.int64)
    counters = torch.arange(N_DRAWS, dtype=torch.int64)
    tokens = exponential_race(probs.clone(), None, None, seeds, counters)
    _check_distribution(tokens, probs[0])


def test_seeded_noise_is_exponential():
    e = seeded_exponentials(torch.tensor([0, -1, 2**62]), torch.tensor([0, 5, 7]), 40_000)
    assert e.dtype == torch.float32 and bool((e > 0).all()) and bool(torch.isfinite(e).all())
    assert stats.kstest(e.flatten().numpy(), "expon").pvalue > 1e-3


def test_generator_noise_is_exponential_and_reproducible():
    # the unseeded rows' noise (on the CPU -log of a uniform draw, not exponential_)
    probs = torch.full((4, 40_000), 1 / 40_000)
    e = _generator_exponentials(probs, torch.Generator().manual_seed(3))
    assert e.shape == probs.shape and e.dtype == torch.float32 and bool((e > 0).all())
    assert stats.kstest(e.flatten().numpy(), "expon").pvalue > 1e-3
    assert torch.equal(e, _generator_exponentials(probs, torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("seeded", [True, False])
def test_top_k_distribution_is_renormalised(seeded):
    states = _many(N_DRAWS, seeded, temperature=1.0, top_k=3)
    out = _run(_LOGITS.repeat(N_DRAWS, 1), states, torch.Generator().manual_seed(9))
    top3 = _LOGITS.topk(3).indices
    expected = torch.zeros(V_SMALL)
    expected[top3] = torch.softmax(_LOGITS[top3], -1)
    _check_distribution(out.sampled_token_ids, expected)


# ---------------------------------------------------------------- seeds


def _py_uniform(seed: int, counter: int, token: int) -> float:
    """The documented hash in plain Python ints: the contract that CPU and GPU share."""
    m = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    key = mix(mix(seed & m) ^ counter)
    h = mix((key + (token + 1) * 0x9E3779B97F4A7C15) & m)
    return ((h >> 12) + 0.5) / 2**52


def test_seeded_noise_matches_reference_hash():
    seeds = [0, 1, -5, 2**63 + 17, 123456789]
    counters = [0, 3, 1, 1000, 2**40]
    e = seeded_exponentials(torch.tensor([wrap_seed(s) for s in seeds]), torch.tensor(counters), 50)
    for r, (s, c) in enumerate(zip(seeds, counters)):
        for t in (0, 1, 17, 49):
            expected = torch.tensor(-math.log(_py_uniform(s, c, t)), dtype=torch.float32)
            assert e[r, t].item() == expected.item()  # fp64 log rounded to fp32: exact


def test_seeded_reproducible_across_batches_and_positions():
    v = 1000
    row = torch.randn(v, generator=torch.Generator().manual_seed(3)) * 0.1  # nearly flat
    target = dict(temperature=0.9, top_p=0.95, seed=42, output=[1, 2, 3])
    alone = _run(row.unsqueeze(0), [_state(**target)]).sampled_token_ids.item()
    noise = torch.randn(5, v)
    batch = torch.cat([noise[:3], row.unsqueeze(0), noise[3:]])
    others = [_state(temperature=0.5), _state(temperature=0.0), _state(seed=1, top_k=5),
              _state(**target), _state(min_p=0.1), _state(presence_penalty=1.0, output=[4])]
    for gen_seed in (0, 1):
        out = _run(batch, others, torch.Generator().manual_seed(gen_seed)).sampled_token_ids
        assert out[3].item() == alone
    moved = _run(torch.stack([row, row]), [_state(seed=5), _state(**target)])
    assert moved.sampled_token_ids[1].item() == alone
    by_seed = {_run(row.unsqueeze(0), [_state(**{**target, "seed": s})]).sampled_token_ids.item()
               for s in range(20)}
    by_step = {_run(row.unsqueeze(0), [_state(**{**target, "output": [0] * n})])
               .sampled_token_ids.item() for n in range(20)}
    assert len(by_seed) > 10 and len(by_step) > 10
    # n > 1: sample i uses seed + i, so children of one request differ from each other
    kids = _run(row.repeat(2, 1), [_state(**target, index=0), _state(**target, index=1)])
    twin = _run(row.unsqueeze(0), [_state(**{**target, "seed": 43})]).sampled_token_ids.item()
    assert kids.sampled_token_ids[1].item() == twin


# ---------------------------------------------------------------- penalties and masks


def test_penalties_exact():
    v = 6
    logits = torch.tensor([[1.0, -2.0, 3.0, -0.5, 0.7, 2.0]] * 3)
    prompt, output = [0, 1, 1], [2, 2, 3]
    pen = dict(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    states = [_state(prompt=prompt, output=output, **pen), _state(prompt=prompt, output=output),
              _state(prompt=[5], output=[], repetition_penalty=2.0)]
    got = process_logits(logits, SamplingBatch.build(states, v, "cpu"))
    expected = logits.clone()
    for t in range(v):
        x = logits[0, t].item()
        if t in prompt or t in output:
            x = x / 1.5 if x > 0 else x * 1.5
        cnt = output.count(t)
        expected[0, t] = x - 0.3 * cnt - 0.2 * (cnt > 0)
    expected[2, 5] = 1.0  # 2.0 / 2 (prompt token only)
    torch.testing.assert_close(got, expected)
    # every row with penalties (rows index = None path) gives the same numbers
    only = process_logits(logits[:1], SamplingBatch.build(states[:1], v, "cpu"))
    torch.testing.assert_close(only, expected[:1])


def test_min_tokens_masks_stop_and_eos_until_reached():
    v = 8
    logits = torch.zeros(4, v)
    logits[:, 4] = 10.0  # eos would win greedily
    kw = dict(temperature=0.0, min_tokens=3, stop_token_ids=[2])
    states = [_state(output=[1], eos={4}, **kw), _state(output=[1, 1, 1], eos={4}, **kw),
              _state(output=[], eos={4}, ignore_eos=True, **kw), _state(output=[], eos={4, 99})]
    batch = SamplingBatch.build(states, v, "cpu")
    got = process_logits(logits, batch)
    assert _kept(got) == [[0, 1, 3, 5, 6, 7], list(range(8)), [0, 1, 3, 4, 5, 6, 7], list(range(8))]
    assert Sampler()(logits, batch).sampled_token_ids.tolist() == [0, 4, 4, 4]


def test_logit_bias_and_allowed_token_ids():
    v = 10
    logits = torch.randn(3, v, generator=torch.Generator().manual_seed(4))
    states = [_state(logit_bias={3: 1.5, 7: -2.0}), _state(allowed_token_ids=[2, 5]),
              _state(allowed_token_ids=[6], logit_bias={6: 0.25})]
    got = process_logits(logits, SamplingBatch.build(states, v, "cpu"))
    expected = logits.clone()
    expected[0, 3] += 1.5
    expected[0, 7] -= 2.0
    expected[1, [0, 1, 3, 4, 6, 7, 8, 9]] = NEG_INF
    expected[2] = NEG_INF
    expected[2, 6] = logits[2, 6] + 0.25
    torch.testing.assert_close(got, expected)
    draws = _run(logits[1:2].repeat(500, 1), [states[1]] * 500, torch.Generator().manual_seed(0))
    assert set(draws.sampled_token_ids.tolist()) == {2, 5}


def test_vocab_validation():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingBatch.build([_state(logit_bias={10: 1.0})], 10, "cpu")
    with pytest.raises(ValueError, match="allowed_token_ids"):
        validate_for_vocab(SamplingParams(allowed_token_ids=[-1]), 10)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        validate_for_vocab(SamplingParams(allowed_token_ids=[]), 10)
    validate_for_vocab(SamplingParams(allowed_token_ids=[9], logit_bias={0: 1.0}), 10)


# ---------------------------------------------------------------- logprobs and batch shape


def test_logprobs_are_raw_with_sampled_first_and_ranks():
    v = 50
    logits = torch.randn(4, v, generator=torch.Generator().manual_seed(8)) * 3
    states = [_state(temperature=0.5, logprobs=3, logit_bias={0: 100.0}),
              _state(temperature=0.0, logprobs=0, repetition_penalty=1.8, prompt=[1, 2]),
              _state(temperature=2.0, top_k=5, seed=1),
              _state(temperature=1.0, allowed_token_ids=[7, 8], logprobs=1)]
    out = _run(logits, states, torch.Generator().manual_seed(0))
    ref = torch.log_softmax(logits, -1)
    assert out.logprob_token_ids.shape == (4, 4) and out.logprobs.shape == (4, 4)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert out.sampled_token_ids[0].item() == 0 and out.sampled_token_ids[3].item() in (7, 8)
    top = ref.topk(3, -1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.logprob_token_ids))
    for r, tok in enumerate(out.sampled_token_ids.tolist()):
        assert out.sampled_ranks[r].item() == int((ref[r] >= ref[r, tok]).sum())
    host = out.to_host()
    assert host.sampled_token_ids == out.sampled_token_ids.tolist()
    assert host.logprob_token_ids == out.logprob_token_ids.tolist()
    assert host.logprobs == out.logprobs.tolist() and host.sampled_ranks == out.sampled_ranks.tolist()


def test_caller_logits_untouched_and_bf16_random_path():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    before = logits.clone()
    states = [_state(top_k=4, top_p=0.8, min_p=0.1, frequency_penalty=1.0, output=[3]),
              _state(temperature=0.0, logit_bias={5: 3.0}), _state(seed=3, allowed_token_ids=[1, 2])]
    out = _run(logits, states, torch.Generator().manual_seed(0))
    assert torch.equal(logits, before)
    assert out.sampled_token_ids[2].item() in (1, 2)
    assert _run(logits.float(), states[:1] * 3, torch.Generator()).sampled_token_ids.shape == (3,)


def test_common_path_builds_only_temperature():
    batch = SamplingBatch.build([_state(temperature=0.8), _state(top_k=-1)], 100, "cpu")
    assert batch.temperature.tolist() == pytest.approx([0.8, 1.0])
    assert batch.all_random and not batch.all_greedy and not batch.modifies_logits
    optional = (batch.greedy_mask, batch.top_k, batch.top_p, batch.min_p, batch.seeds,
                batch.penalties, batch.logit_add_index, batch.blocked_mask, batch.max_num_logprobs)
    assert all(x is None for x in optional)
    greedy = SamplingBatch.build([_state(temperature=0.0)], 100, "cpu")
    assert greedy.all_greedy and greedy.temperature is None
    empty = _run(torch.zeros(0, 100), [])
    assert empty.sampled_token_ids.shape == (0,)
