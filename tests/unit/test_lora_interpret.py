"""Multi-LoRA's Triton gather kernel on the CPU, under Triton's interpreter, against the torch
reference (`check_lora_delta` of tests/gpu/test_lora_gpu.py, small shapes, slot -1 rows, rows of
one slot spread over the step, segments longer than one tile)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from interpreter_child import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "gpu" / "test_lora_gpu.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHILD = r"""
res = {}
res["fp32 t9 in40 out70 r8 s3"] = checks.check_lora_delta(9, 40, 70, 8, 3, f32, "cpu", seed=1)
res["fp16 t5 in200 out33 r16 s2"] = checks.check_lora_delta(5, 200, 33, 16, 2, f16, "cpu", seed=2)
res["fp32 t1 in16 out16 r4 s1"] = checks.check_lora_delta(1, 16, 16, 4, 1, f32, "cpu", seed=3)
res["fp32 t150 in72 out200 r8 s4"] = checks.check_lora_delta(150, 72, 200, 8, 4, f32, "cpu", seed=4)  # BLOCK_M 64
print("RESULT " + json.dumps(res))
"""


def test_lora_kernel_matches_reference_under_interpreter():
    res = run_under_interpreter(CHILD, CHECKS, timeout_s=300)
    assert len(res) == 4
    bad = {name: fails for name, fails in res.items() if fails}
    assert not bad, f"kernel differs from the torch reference: {bad}"


def test_slot_segments_at_the_edges():
    """The kernel's grouping of rows by slot: no rows, no row with an adapter, every row in one
    slot, slots in descending order (rows stay ascending within a slot), an empty slot."""
    import torch

    from minivllm.lora.ops import slot_segments

    def seg(slots, n):
        order, start, count = slot_segments(torch.tensor(slots, dtype=torch.int32), n)
        assert order.dtype == start.dtype == count.dtype == torch.int32 and order.shape[0] == len(slots)
        return [order[s:s + c].tolist() for s, c in zip(start.tolist(), count.tolist())]

    assert seg([], 2) == [[], []]
    assert seg([-1, -1, -1], 2) == [[], []]
    assert seg([1, 1, 1, 1], 2) == [[], [0, 1, 2, 3]]
    assert seg([2, 1, 0, -1, 2, 0], 4) == [[2, 5], [1], [0, 4], []]
