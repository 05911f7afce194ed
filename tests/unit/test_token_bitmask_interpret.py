"""The grammar bitmask Triton kernel on the CPU, under Triton's interpreter, against the torch
path (`check_bitmask` of tests/gpu/test_token_bitmask.py, small shapes, a masked vocab tail)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from interpreter_child import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "gpu" / "test_token_bitmask.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHILD = r"""
res = {}
res["fp32 b5 r3 v100"] = checks.check_bitmask(5, 3, 100, f32, "cpu", seed=1, block=64)
res["fp16 b4 r4 v1000 padded"] = checks.check_bitmask(4, 4, 1000, f16, "cpu", seed=2, extra_words=3, block=256)
res["fp32 b1 r1 v33"] = checks.check_bitmask(1, 1, 33, f32, "cpu", seed=3, block=32)
print("RESULT " + json.dumps(res))
"""


def test_bitmask_kernel_matches_torch_under_interpreter():
    res = run_under_interpreter(CHILD, CHECKS, timeout_s=300)
    assert len(res) == 3
    bad = {name: fails for name, fails in res.items() if fails}
    assert not bad, f"kernel differs from the torch path: {bad}"
