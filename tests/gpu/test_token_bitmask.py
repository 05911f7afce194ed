"""The grammar bitmask kernel (kernels/token_bitmask.py) against the vectorised torch path
(structured/bitmask.py), which tests/unit/test_structured_manager.py checks against a plain loop.

`check_bitmask` is device-agnostic and returns failure strings (empty = pass):
tests/unit/test_token_bitmask_interpret.py runs it on the CPU under TRITON_INTERPRET=1; the
tests here run it on a CUDA GPU with realistic shapes (Qwen3's 151,936-token vocabulary, 256
rows, bf16). Rows not listed in `rows` must come back unchanged; the kernel only writes -inf.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.structured.bitmask import apply_token_bitmask_torch


def check_bitmask(batch: int, rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int,
                  extra_words: int = 0, block: int = 4096) -> list[str]:
    from minivllm.kernels.token_bitmask import apply_token_bitmask_triton
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g).to(dtype)
    words = (vocab + 31) // 32 + extra_words  # the model's vocab may be padded past the mask's need
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    bitmask[0] = 0 if rows > 1 else bitmask[0]  # a row that allows nothing
    row_ids = torch.randperm(batch, generator=g)[:rows]
    want = logits.clone()
    apply_token_bitmask_torch(want, bitmask, row_ids)
    got = logits.to(device)
    apply_token_bitmask_triton(got, bitmask.to(device), row_ids.to(device), block=block)
    got = got.cpu()
    fails = []
    if not torch.equal(torch.isinf(got), torch.isinf(want)):
        fails.append(f"-inf at {int((torch.isinf(got) != torch.isinf(want)).sum())} wrong places")
    if not torch.equal(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0)):
        fails.append("a kept logit changed")
    return fails


pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.parametrize("batch,rows,vocab", [(256, 256, 151936), (256, 100, 151936), (7, 3, 49152), (1, 1, 33)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bitmask_kernel_matches_torch(batch, rows, vocab, dtype):
    assert check_bitmask(batch, rows, vocab, dtype, "cuda", seed=vocab + rows, extra_words=2) == []


def test_bitmask_kernel_in_the_runner_path():
    """apply_token_bitmask dispatches CUDA logits to the kernel."""
    from minivllm.structured.bitmask import apply_token_bitmask
    logits = torch.zeros(4, 100, device="cuda")
    bitmask = torch.zeros(1, 4, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2 allowed
    apply_token_bitmask(logits, bitmask.cuda(), torch.tensor([2], device="cuda"))
    assert torch.isinf(logits[2]).sum() == 98 and logits[2, 0] == 0 and logits[2, 2] == 0
    assert not torch.isinf(logits[[0, 1, 3]]).any()
