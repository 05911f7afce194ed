"""kernels/seeded_race.py: the seeded exponential race in one pass equals sample/rng.py's torch
form bit for bit (the noise) and token for token (the winners, ties to the lowest id). The
check helpers also run on the CPU under Triton's interpreter (tests/unit/test_seeded_race_interpret.py)."""

from __future__ import annotations

import pytest
import torch

from minivllm.sample.rng import exponential_race, row_keys, seeded_exponentials, wrap_seed


def make_rows(num: int, vocab: int, device: str, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    probs = torch.softmax(torch.randn(num, vocab, generator=g) * 4, dim=-1)
    probs[:, ::7] = 0.0  # masked tokens (top-k / top-p): p = 0 never wins unless the row is all zero
    probs[0, 5:] = 0.0  # a row with few live tokens
    seeds = torch.tensor([wrap_seed(int(x)) for x in torch.randint(-2**62, 2**62, (num,), generator=g)])
    seeds[0], seeds[-1] = 0, wrap_seed(2**64 - 1)
    counters = torch.randint(0, 5000, (num,), generator=g)
    return probs.to(device), seeds.to(device), counters.to(device)


def check_noise_and_ids(num: int, vocab: int, device: str, seed: int) -> tuple[bool, bool]:
    """(noise bit-equal to seeded_exponentials, ids equal to the torch race) for all rows."""
    from minivllm.kernels.seeded_race import seeded_race
    probs, seeds, counters = make_rows(num, vocab, device, seed)
    noise = torch.empty(num, vocab, device=device)
    ids = seeded_race(probs, row_keys(seeds, counters), None, noise)
    ref_noise = seeded_exponentials(seeds, counters, vocab)
    ref_ids = probs.clone().div_(ref_noise).argmax(dim=-1)
    return torch.equal(noise, ref_noise), torch.equal(ids, ref_ids)


def check_subset_rows(vocab: int, device: str, seed: int) -> bool:
    """Some rows seeded (any order), the rest left to the caller: the ids of the seeded rows."""
    from minivllm.kernels.seeded_race import seeded_race
    probs, seeds, counters = make_rows(6, vocab, device, seed)
    rows = torch.tensor([4, 0, 2], device=device)
    ids = seeded_race(probs, row_keys(seeds[:3], counters[:3]), rows)
    ref = probs[rows].div(seeded_exponentials(seeds[:3], counters[:3], vocab)).argmax(dim=-1)
    return torch.equal(ids, ref)


def check_ties_go_to_the_lowest_id(device: str) -> bool:
    """Three live tokens with p_t = E_t / 8 (exact: a power of two) all score exactly 1/8 under
    IEEE division, every other token scores 0: the winner must be the lowest of the three ids,
    as torch.argmax picks."""
    from minivllm.kernels.seeded_race import seeded_race
    seeds, counters = torch.tensor([7], device=device), torch.tensor([3], device=device)
    vocab = 3000
    e = seeded_exponentials(seeds, counters, vocab)[0]
    probs = torch.zeros(1, vocab, device=device)
    for t in (2999, 17, 1500):
        probs[0, t] = e[t] * 0.125
    ids = seeded_race(probs, row_keys(seeds, counters))
    return int(ids[0]) == 17 == int(probs.clone().div_(e[None]).argmax(dim=-1)[0])


pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num,vocab", [(1, 151936), (37, 151936), (256, 32000), (3, 1000)])
def test_seeded_race_matches_the_torch_form(num, vocab):
    noise_ok, ids_ok = check_noise_and_ids(num, vocab, "cuda", seed=num + vocab)
    assert noise_ok and ids_ok, (noise_ok, ids_ok)


def test_seeded_subset_and_ties():
    assert check_subset_rows(5000, "cuda", seed=1)
    assert check_ties_go_to_the_lowest_id("cuda")


def test_exponential_race_uses_the_kernel_and_keeps_the_generator_draws(monkeypatch):
    """Mixed batch: seeded rows from the kernel, the others from the generator, which draws for
    every row as before (the same tokens as the torch form with the same generator state)."""
    probs, seeds, counters = make_rows(8, 20000, "cuda", seed=5)
    rows = torch.tensor([1, 6], device="cuda")
    got = exponential_race(probs.clone(), torch.Generator(device="cuda").manual_seed(3), rows, seeds[rows],
                           counters[rows])
    monkeypatch.setenv("MINIVLLM_SEEDED_RACE_KERNEL", "0")
    want = exponential_race(probs.clone(), torch.Generator(device="cuda").manual_seed(3), rows, seeds[rows],
                            counters[rows])
    assert torch.equal(got, want)
