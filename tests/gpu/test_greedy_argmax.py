"""kernels/greedy_argmax.py: the chunked argmax equals torch.argmax token for token (first maximum
on ties, the first NaN, rows of -inf, several rows, float16/bfloat16/float32, vocabularies that are
and are not a multiple of the chunk). The check helpers also run on the CPU under Triton's
interpreter (tests/unit/test_greedy_argmax_interpret.py)."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import greedy_argmax as ga


def make_logits(rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Random rows with planted edge cases: row 0's maximum tied at three tokens in three chunks
    (the first must win), row 1 a NaN after its maximum, row 2 all -inf, the last row a maximum at
    the last token (the partial last chunk)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    top = torch.tensor(40.0, dtype=dtype)
    if rows > 0:
        for t in sorted({vocab - 1, vocab // 2, min(5, vocab - 1)}, reverse=True):
            x[0, t] = top
    if rows > 1:
        x[1, vocab // 3] = top
        x[1, vocab - 2] = float("nan")
    if rows > 2:
        x[2] = float("-inf")
    if rows > 3:
        x[-1, vocab - 1] = top
    return x.to(device)


def check_equals_torch(rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int) -> bool:
    x = make_logits(rows, vocab, dtype, device, seed)
    return torch.equal(ga.argmax_rows(x).cpu(), x.float().cpu().argmax(dim=-1))


def check_strided_rows(device: str) -> bool:
    """Rows of a wider buffer (a row stride beyond V), as a slice of logits."""
    x = make_logits(5, 7000, torch.float32, device, seed=3)
    view = x[:, :5000]
    return torch.equal(ga.argmax_rows(view).cpu(), view.cpu().argmax(dim=-1))


pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows,vocab", [(1, 128256), (1, 151936), (7, 32000), (256, 128256), (3, 2048), (4, 100)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_greedy_argmax_equals_torch(rows, vocab, dtype):
    assert check_equals_torch(rows, vocab, dtype, "cuda", seed=rows + vocab)


def test_greedy_argmax_strided_rows_and_repeats():
    assert check_strided_rows("cuda")
    x = make_logits(3, 50000, torch.float16, "cuda", seed=9)
    first = ga.argmax_rows(x)
    for _ in range(20):  # the row counters are 0 again after every launch
        assert torch.equal(ga.argmax_rows(x), first)


def test_sampler_greedy_rows_use_it(monkeypatch):
    """greedy_argmax takes the kernel on CUDA and torch.argmax with MINIVLLM_ARGMAX_KERNEL=0: the same tokens."""
    x = make_logits(4, 128256, torch.bfloat16, "cuda", seed=11)
    assert ga.kernel_enabled(x)
    got = ga.greedy_argmax(x)
    monkeypatch.setenv("MINIVLLM_ARGMAX_KERNEL", "0")
    assert not ga.kernel_enabled(x)
    assert torch.equal(got, ga.greedy_argmax(x))
