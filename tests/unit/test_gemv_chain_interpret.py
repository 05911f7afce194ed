"""The experimental persistent GEMV chain (kernels/gemv_chain.py) on the CPU under Triton's
interpreter, one program (see tests/gpu/test_gemv_chain.py): its stage loop, work items, split-K
fix-up and barrier counting give the separate GEMV launches' bits and the reference's values."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from interpreter_child import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "gpu" / "test_gemv_chain.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHILD = r"""
res = {}
# widening, narrowing, a ragged N (40: the last tile masked), a stage whose one K step leaves the
# second K slice empty (K = 64 = BLOCK_K, split 2), group 32 and per-channel-like group = K
res["even"] = checks.check_chain([(128, 256), (64, 128), (256, 64), (64, 256)], 32, "cpu", 1)
res["ragged"] = checks.check_chain([(40, 256), (96, 32), (64, 96)], 32, "cpu", 1, block_n=32, block_k=32, split_k=4)
res["one slice"] = checks.check_chain([(64, 128), (64, 64)], 64, "cpu", 1, split_k=1)
# two programs run one after another here: the first waits at stage 1 for an arrival that cannot
# come, gives up after 16 reads and flags it; the launch still ends (the guard against a hang)
res["stuck"] = checks.check_chain([(64, 128), (64, 64)], 64, "cpu", 2, max_polls=16)
print("RESULT " + json.dumps(res))
"""


def test_chain_matches_separate_launches_under_interpreter() -> None:
    results = run_under_interpreter(CHILD, CHECKS, timeout_s=600)
    stuck = results.pop("stuck")
    assert stuck["timed_out"] and stuck["programs"] == 2, stuck
    for name, res in results.items():
        assert res["same_bits"], (name, res)
        assert res["max_err"] < 2e-3, (name, res)
        assert res["counters_zero"] and res["programs"] == 1 and not res["timed_out"], (name, res)
