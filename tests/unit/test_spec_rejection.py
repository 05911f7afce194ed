"""Speculative decoding's verification (spec_decode/rejection.py): greedy verification is exactly
greedy decoding, and the rejection rule leaves every emitted token distributed by the target's p
(chi-square over many independent rows), with point-mass drafts, with sampled drafts of a
deliberately bad q, seeded or not."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from minivllm.sample.batch import SamplingBatch, SamplingRequestState
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.rejection import VerifyLayout, target_probs, verify

V, K = 6, 3


def _batch(n_rows: int, params: SamplingParams, seed: int = 5) -> SamplingBatch:
    """Rows of requests of K + 1 rows each (row j: j tokens generated); request i is sample i of
    its params, so seeded requests get distinct seeds (seed + i)."""
    states = [SamplingRequestState(params, [1], [0] * (i % (K + 1)), sample_index=i // (K + 1))
              for i in range(n_rows)]
    return SamplingBatch.build(states, V, "cpu", torch.Generator().manual_seed(seed))


def test_greedy_accepts_the_argmax_run_then_corrects():
    # rows of 2 requests: A (3 drafts) then B (no draft)
    logits = torch.full((5, V), -1.0)
    argmax = [2, 4, 1, 3, 5]  # A0 A1 A2 A3 | B0
    for r, t in enumerate(argmax):
        logits[r, t] = 1.0
    for drafts, expected in (([2, 4, 1], [2, 4, 1, 3]), ([2, 0, 1], [2, 4]), ([5, 4, 1], [2]), ([], None)):
        layout = VerifyLayout.build([drafts, []], torch.device("cpu")) if drafts else VerifyLayout.build([[], []], "cpu")
        rows = logits if drafts else logits[[0, 4]]
        batch = _batch(rows.shape[0], SamplingParams(temperature=0.0))
        out = verify(layout, batch, rows.argmax(-1), None)
        n = out.num_tokens.tolist()
        got = out.tokens[0, :n[0]].tolist()
        assert got == (expected if drafts else [2]), (drafts, got)
        assert out.tokens[1, :n[1]].tolist() == [5]


def _sample_many(p_rows: torch.Tensor, q_rows: torch.Tensor | None, params: SamplingParams, n: int, seed: int):
    """n independent requests, each verifying K drafts (drawn from q, or the fixed worst guesses
    second most likely token when q is None) against the same target rows p_rows [K + 1, V]."""
    g = torch.Generator().manual_seed(seed)
    if q_rows is None:
        drafts = p_rows[:K].topk(2, -1).indices[:, 1].repeat(n, 1)  # never the target's favourite
    else:
        drafts = torch.multinomial(q_rows, n, replacement=True, generator=g).T  # [n, K]
    layout = VerifyLayout.build(drafts.tolist(), torch.device("cpu"))
    rows = n * (K + 1)
    batch = _batch(rows, params, seed)
    logits = p_rows.log().repeat(n, 1)  # temperature 1: target_probs gives back p
    probs = target_probs(logits, batch)
    dq = None if q_rows is None else q_rows_full(q_rows, n)
    return verify(layout, batch, None, probs, dq), drafts


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p.double() / p.double().sum() * counts.sum()
    return chisquare(counts, expected).pvalue


def q_rows_full(q_rows: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([q_rows, torch.full((1, V), 1.0 / V)]).repeat(n, 1)


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("draft_kind", ["point_mass_bad", "sampled_bad_q"])
def test_emitted_tokens_follow_the_target_distribution(draft_kind, seeded):
    torch.manual_seed(0)
    p_rows = torch.softmax(torch.randn(K + 1, V) * 1.5, -1)
    q_rows = None
    if draft_kind == "sampled_bad_q":  # q puts most mass where p puts little
        q_rows = torch.softmax(-torch.log(p_rows[:K]) * 1.2, -1)
    params = SamplingParams(temperature=1.0, seed=1234 if seeded else None)
    n = 12000
    out, drafts = _sample_many(p_rows, q_rows, params, n, seed=3)
    first = out.tokens[:, 0]
    counts = torch.bincount(first, minlength=V).double()
    assert _chi2(counts, p_rows[0]) > 0.01
    # given the first draft was accepted, the second token is distributed by p_1
    took = (out.num_tokens > 1) & (out.tokens[:, 0] == drafts[:, 0])
    second = out.tokens[took, 1]
    m = int(took.sum())
    assert m > 500
    counts2 = torch.bincount(second, minlength=V).double()
    assert _chi2(counts2, p_rows[1]) > 0.01
    # the accepted share of the first draft is sum_x min(p, q): well below 1 for a bad draft
    accepted = (out.num_tokens > 1).double().mean().item()
    q0 = torch.zeros(V).scatter_(0, drafts[0, :1], 1.0) if q_rows is None else q_rows[0]
    assert accepted == pytest.approx(torch.minimum(p_rows[0], q0).sum().item(), abs=0.02)


def test_seeded_rows_are_reproducible_and_others_not_tied_to_them():
    torch.manual_seed(1)
    p_rows = torch.softmax(torch.randn(K + 1, V), -1)
    seeded = SamplingParams(temperature=1.0, seed=7)
    a, _ = _sample_many(p_rows, None, seeded, 50, seed=3)
    b, _ = _sample_many(p_rows, None, seeded, 50, seed=99)  # another generator state: same seeded output
    assert torch.equal(a.tokens, b.tokens)
    c, _ = _sample_many(p_rows, None, SamplingParams(temperature=1.0), 50, seed=3)
    d, _ = _sample_many(p_rows, None, SamplingParams(temperature=1.0), 50, seed=99)
    assert not torch.equal(c.tokens, d.tokens)  # unseeded rows follow the generator


class _ArgmaxModel:
    """A stand-in target: its LM head is a fixed random [V, H] matrix."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.T

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden).argmax(-1)


@pytest.mark.parametrize("seed", range(5))
def test_host_greedy_verify_equals_the_device_rule(seed, monkeypatch):
    """The host-side greedy verification (speculator._verify_greedy_on_host) gives the same
    tokens and final hidden rows as rejection.verify on random drafts, some matching the argmax."""
    from minivllm.spec_decode import speculator as spec_mod
    from minivllm.spec_decode.config import SpeculativeConfig
    g = torch.Generator().manual_seed(seed)
    hidden_size, vocab = 8, 12
    model = _ArgmaxModel(torch.randn(vocab, hidden_size, generator=g))
    counts = torch.randint(0, 5, (6,), generator=g).tolist()
    rows = sum(counts) + len(counts)
    hidden = torch.randn(rows, hidden_size, generator=g)
    argmax = model.compute_greedy_tokens(hidden).tolist()
    drafts, start = [], 0
    for c in counts:  # each draft is the row before's argmax with probability 0.7: real accept runs
        drafts.append([argmax[start + j] if torch.rand(1, generator=g).item() < 0.7
                       else int(torch.randint(0, vocab, (1,), generator=g)) for j in range(c)])
        start += c + 1
    states = [SamplingRequestState(SamplingParams(temperature=0.0, max_tokens=16), [1], []) for _ in counts]
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    results = {}
    for host in (True, False):
        monkeypatch.setattr(spec_mod, "HOST_VERIFY", host)
        results[host] = spec_mod.Speculator(config, proposer=None).verify(model, hidden, states, drafts, None)
    assert results[True].tokens == results[False].tokens
    assert any(len(t) > 1 for t in results[True].tokens)  # some drafts were accepted
    torch.testing.assert_close(results[True].final_hidden, results[False].final_hidden, rtol=0, atol=0)
