"""kernels/block_copy.py on the CPU under Triton's interpreter (the check of
tests/gpu/test_block_transfer_gpu.py, in one child process: see tests/unit/test_triton_interpret.py
for why): random block pairs between two pools of mixed block sizes copy exactly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from interpreter_child import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "gpu" / "test_block_transfer_gpu.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHILD = r"""
res = {str(seed): checks.check_block_copy("cpu", seed) for seed in range(2)}
print("RESULT " + json.dumps(res))
"""


def test_block_copy_kernel_under_the_interpreter():
    res = run_under_interpreter(CHILD, CHECKS, timeout_s=300)
    for seed, r in res.items():
        assert r["ok"] and r["copied"] == 13, (seed, r)
