"""The fused per-token kernels on the CPU, under Triton's interpreter, against the torch math.

TRITON_INTERPRET=1 must be set before triton is first imported, so the checks run in one child
process that reuses the `check_*` helpers of tests/gpu/test_fused_ops.py on small shapes and
prints one JSON object {case name: [failure strings]}. fp32 and fp16 only: the interpreter's
bf16 conversions do not round like the GPU's (bf16 is covered by the GPU tests).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from interpreter_child import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "gpu" / "test_fused_ops.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHILD = r"""
res = {}
for dt, name in ((f32, "fp32"), (f16, "fp16")):
    # hidden 96: BLOCK 128 with a masked tail; 64: exact power of two
    res[f"rms_norm {name} T5 H96"] = checks.check_rms_norm(5, 96, dt, "cpu", seed=1)
    res[f"rms_norm {name} T3 H64"] = checks.check_rms_norm(3, 64, dt, "cpu", seed=2)
    res[f"head_norm {name} T4 h6 d32"] = checks.check_head_norm(4, 6, 32, dt, "cpu", seed=3)
    res[f"fused_add {name} T5 H96"] = checks.check_fused_add_rms_norm(5, 96, dt, "cpu", seed=4)
    res[f"rotary {name} T5 q4 k2 d32"] = checks.check_rotary(5, 4, 2, 32, dt, "cpu", seed=5, max_pos=64)
    res[f"rotary {name} T3 q3 k3 d16"] = checks.check_rotary(3, 3, 3, 16, dt, "cpu", seed=6, max_pos=64)
    res[f"silu_and_mul {name} T4 I100"] = checks.check_silu_and_mul(4, 100, dt, "cpu", seed=7)
    res[f"qk_norm_rotary {name} T5 q4 k2 d32"] = checks.check_qk_norm_rotary(5, 4, 2, 32, dt, "cpu", seed=8, max_pos=64)
    res[f"qk_norm_rotary {name} T3 q6 k1 d24"] = checks.check_qk_norm_rotary(3, 6, 1, 24, dt, "cpu", seed=9, max_pos=64)
    res[f"rotary_store_kv {name} T3 q4 k2 d32"] = checks.check_rotary_store_kv(3, 4, 2, 32, dt, "cpu", seed=10)
    res[f"rotary_store_kv {name} T5 q6 k1 d24 norm"] = checks.check_rotary_store_kv(5, 6, 1, 24, dt, "cpu", seed=11,
                                                                                    norm=True, block_size=4)
res["rotary_store_kv fp16 T4 q4 k2 d32 fp8"] = checks.check_rotary_store_kv(4, 4, 2, 32, f16, "cpu", seed=12, fp8=True)
res["dispatch cpu"] = checks.check_dispatch("cpu")
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[str]]:
    return run_under_interpreter(CHILD, CHECKS, timeout_s=300)


@pytest.mark.parametrize("kernel", ["rms_norm", "head_norm", "fused_add", "rotary", "qk_norm_rotary", "silu_and_mul",
                                    "rotary_store_kv", "dispatch"])
def test_fused_kernel_matches_torch_under_interpreter(interpreter_results: dict[str, list[str]], kernel: str) -> None:
    cases = {name: fails for name, fails in interpreter_results.items() if name.startswith(kernel + " ")}
    assert cases, f"no {kernel} cases ran"
    bad = {name: fails for name, fails in cases.items() if fails}
    assert not bad, f"kernel differs from the torch math: {bad}"
