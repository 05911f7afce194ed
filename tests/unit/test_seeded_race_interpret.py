"""kernels/seeded_race.py under Triton's interpreter on the CPU: the noise bit for bit and the
winning ids equal sample/rng.py's torch form (the GPU run is tests/gpu/test_seeded_race.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from interpreter_child import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "gpu" / "test_seeded_race.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHILD = r"""
res = {}
for num, vocab in [(1, 5000), (9, 2500), (4, 1023)]:
    res[f"all rows {num}x{vocab}"] = list(checks.check_noise_and_ids(num, vocab, "cpu", seed=num))
res["subset"] = [checks.check_subset_rows(3000, "cpu", seed=2)]
res["ties"] = [checks.check_ties_go_to_the_lowest_id("cpu")]
print("RESULT " + json.dumps(res))
"""


def test_seeded_race_matches_the_torch_form_under_interpreter():
    res = run_under_interpreter(CHILD, CHECKS, timeout_s=600)
    assert res and all(all(v) for v in res.values()), res
