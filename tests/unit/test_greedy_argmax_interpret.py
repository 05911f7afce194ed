"""kernels/greedy_argmax.py under Triton's interpreter on the CPU: the chunked argmax equals
torch.argmax (ties, NaN, -inf, partial chunks; the GPU run is tests/gpu/test_greedy_argmax.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from interpreter_child import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "gpu" / "test_greedy_argmax.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHILD = r"""
res = {}
for rows, vocab in [(1, 5000), (5, 4096), (4, 100), (3, 2049)]:
    for dt in (f16, torch.bfloat16, f32):
        res[f"{rows}x{vocab} {dt}"] = checks.check_equals_torch(rows, vocab, dt, "cpu", seed=rows + vocab)
res["strided"] = checks.check_strided_rows("cpu")
print("RESULT " + json.dumps(res))
"""


def test_greedy_argmax_matches_torch_under_interpreter():
    res = run_under_interpreter(CHILD, CHECKS, timeout_s=600)
    assert res and all(res.values()), res


def test_greedy_argmax_falls_back_to_torch_off_cuda():
    import torch

    from minivllm.kernels.greedy_argmax import greedy_argmax, kernel_enabled
    x = torch.randn(3, 1000)
    assert not kernel_enabled(x)
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
