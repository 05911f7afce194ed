"""The batch-invariant matmul's Triton kernel on the CPU, under Triton's interpreter: the
product against torch (check_matmul of tests/gpu/test_invariant_gemm.py; fp32 and fp16:
the interpreter mis-multiplies bf16; bf16 and the bitwise invariance of real MMAs are checked
on the GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from interpreter_child import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "gpu" / "test_invariant_gemm.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHILD = r"""
res = {}
res["fp32 m1 n200 k96 bias"] = checks.check_matmul(1, 200, 96, f32, "cpu", seed=1, bias=True, bitwise=False)
res["fp32 m70 n130 k130"] = checks.check_matmul(70, 130, 130, f32, "cpu", seed=2, bias=False, bitwise=False)
res["fp16 m5 n128 k64"] = checks.check_matmul(5, 128, 64, f16, "cpu", seed=3, bias=False, bitwise=False)
print("RESULT " + json.dumps(res))
"""


def test_invariant_matmul_under_interpreter():
    res = run_under_interpreter(CHILD, CHECKS, timeout_s=600)
    assert len(res) == 3
    bad = {name: problems for name, problems in res.items() if problems}
    assert not bad, bad
