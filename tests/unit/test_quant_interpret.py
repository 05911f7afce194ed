"""The W4A16 GEMM and the FP8-KV attention kernels on the CPU under Triton's interpreter, against
their references (the checks of tests/gpu/test_quant_kernels.py, in one child process: see
tests/unit/test_triton_interpret.py for why)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from interpreter_child import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "gpu" / "test_quant_kernels.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHILD = r"""
res = {}
small = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128}
# (name, m, n, k, group, dtype, split_k, act_order): ragged N and K tails, every group size, split-K
for name, m, n, k, g, dt, split, act in [
        ("w4a16 m1 g64 fp32", 1, 64, 256, 64, f32, 1, False),
        ("w4a16 m3 g128 split2 fp32", 3, 96, 512, 128, f32, 2, False),
        ("w4a16 m17 channel fp16", 17, 64, 384, -1, f16, 1, False),
        ("w4a16 m5 g32 split4 ragged fp32", 5, 40, 320, 32, f32, 4, False),
        ("w4a16 m2 g32 act-order fp32", 2, 48, 256, 32, f32, 2, True)]:
    res[name] = checks.check_w4a16(m, n, k, g, dt, "cpu", seed=m, split_k=split, config=small, act_order=act)
    # K steps inside one group (small's BLOCK_K 128 spans several groups of 32 and 64)
    res[name + " bk32"] = checks.check_w4a16(m, n, k, g, dt, "cpu", seed=m, split_k=split,
                                             config=dict(small, BLOCK_K=32), act_order=act)
    gemv = dict(small, BLOCK_M=1)  # the one-row kernel
    res[name + " gemv"] = checks.check_w4a16(m, n, k, g, dt, "cpu", seed=m, split_k=split, config=gemv, act_order=act)
    res[name + " gemv pipelined"] = checks.check_w4a16(m, n, k, g, dt, "cpu", seed=m, split_k=split,
                                                       config=dict(gemv, PIPE=True), act_order=act)
    if dt != f32:  # 16-bit scales and zeros interleaved (the GPU loader's layout): read as one word
        for pipe in (True, False):
            res[name + f" gemv pairs pipe={pipe}"] = checks.check_w4a16(
                m, n, k, g, dt, "cpu", seed=m, split_k=split, config=dict(gemv, PIPE=pipe, SZ_PAIRS=True),
                act_order=act, pairs=True)
res["w4a16 dequant g64"] = checks.check_w4a16_dequant(72, 256, 64, f32, "cpu")
res["w4a16 dequant g128 fp16"] = checks.check_w4a16_dequant(40, 256, 128, f16, "cpu", seed=1)
# the GEMV's in-kernel split-K sum: N = 75 leaves a ragged last tile; K = 512 is 4 K slices of
# 128, so split 8 leaves programs with no slice (they add a zero partial); m 2: a counter per row
gemv = {"BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 128}
fixup = {}
for split in (1, 2, 4, 8):
    for m, g, dt in [(1, 128, f32), (2, 64, torch.bfloat16)]:
        fixup[f"split{split} m{m} g{g} {str(dt)[6:]}"] = checks.check_w4a16_split_fixup(
            m, 75, 512, g, dt, "cpu", split, gemv, seed=split + m)
        fixup[f"split{split} m{m} g{g} {str(dt)[6:]} pipelined"] = checks.check_w4a16_split_fixup(
            m, 75, 512, g, dt, "cpu", split, dict(gemv, PIPE=True), seed=split + m)
        if dt != f32:
            fixup[f"split{split} m{m} g{g} {str(dt)[6:]} pairs"] = checks.check_w4a16_split_fixup(
                m, 75, 512, g, dt, "cpu", split, dict(gemv, PIPE=True, SZ_PAIRS=True), seed=split + m, pairs=True)
res["fixup"] = fixup
# SZ_PAIRS reads the same scales and zeros as the two tiles: the same bits (ragged N and K tails)
from minivllm.kernels import w4a16_gemm as w4k
same = {}
for dt in (f16, torch.bfloat16):
    for pipe in (True, False):
        x, qw, s, z, _ = checks.w4_case(2, 75, 320, 32, dt, "cpu", seed=3)
        _, _, sp, zp, _ = checks.w4_case(2, 75, 320, 32, dt, "cpu", seed=3, pairs=True)
        cfg = dict(gemv, PIPE=pipe)
        same[f"{str(dt)[6:]} pipe={pipe}"] = [w4k.scale_zero_pairs(sp, zp), w4k.scale_zero_pairs(s, z), torch.equal(
            w4k.w4a16_gemm(x, qw, s, z, 32, 2, cfg), w4k.w4a16_gemm(x, qw, sp, zp, 32, 2, dict(cfg, SZ_PAIRS=True)))]
res["pairs_same_bits"] = same
mixed = [(37, 60), (1, 45), (20, 20), (5, 90), (1, 1), (10, 72)]
decode = [(1, 60), (1, 1), (1, 97), (1, 300)]
res["fp8kv decode fp32 gqa4"] = checks.check_fp8_attention(checks.make_case(decode, 8, 2, 64, 16, f32, "cpu", 5), "decode")
res["fp8kv decode fp16 gqa1"] = checks.check_fp8_attention(checks.make_case(decode, 4, 4, 64, 16, f16, "cpu", 6), "decode")
res["fp8kv decode fp16 gqa4"] = checks.check_fp8_attention(checks.make_case(decode, 8, 2, 64, 16, f16, "cpu", 9), "decode")
res["fp8kv prefill fp32 gqa2"] = checks.check_fp8_attention(checks.make_case(mixed, 4, 2, 64, 16, f32, "cpu", 7), "prefill")
res["fp8kv prefill fp16 gqa4"] = checks.check_fp8_attention(checks.make_case(mixed, 8, 2, 64, 32, f16, "cpu", 8), "prefill")
act = {}
for kind in ("norm", "add_norm", "silu"):
    for m, h, dt in [(3, 576, f32), (2, 1000, f16)]:
        act[f"{kind} m{m} h{h} {str(dt)[6:]}"] = checks.check_fp8_act(kind, m, h, dt, "cpu", seed=m)
res["fp8act"] = act
# zero rows: no launch, empty rows and scales of the right shapes
from minivllm.kernels import fp8_act
e_norm = fp8_act.rms_norm_fp8_triton(torch.empty(0, 64), torch.ones(64), 1e-6, torch.empty(0, 64))
e_silu = fp8_act.silu_and_mul_fp8_triton(torch.empty(0, 128))
res["fp8act_empty"] = [list(e_norm[0].q.shape), list(e_norm[0].scale.shape), list(e_norm[1].shape),
                       list(e_silu.q.shape), list(e_silu.scale.shape)]
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def results() -> dict[str, float]:
    return run_under_interpreter(CHILD, CHECKS, timeout_s=600)


@pytest.mark.parametrize("kernel, tol", [("w4a16 m", 1e-3), ("fp8kv", 2e-3)])
def test_quant_kernels_match_reference_under_interpreter(results: dict[str, float], kernel: str, tol: float) -> None:
    cases = {name: err for name, err in results.items() if name.startswith(kernel)}
    assert cases, f"no {kernel} cases ran"
    bad = {name: err for name, err in cases.items() if not err < tol}
    assert not bad, f"error above {tol}: {bad}"


def test_fused_fp8_activation_quant_under_interpreter(results: dict) -> None:
    """The quantizing norm and SwiGLU give the unfused kernels' bytes and scales, and the scales
    are the torch reference's (the same max over the same rounded row)."""
    cases = results["fp8act"]
    assert len(cases) == 6, cases
    bad = {name: r for name, r in cases.items()
           if not (r["bitwise"] and r["scale_err"] < 1e-6 and r.get("residual_equal", True))}
    assert not bad, bad


def test_fused_fp8_activation_quant_of_zero_rows(results: dict) -> None:
    assert results["fp8act_empty"] == [[0, 64], [0, 1], [0, 64], [0, 64], [0, 1]]


def test_w4a16_dequant_is_exact_under_interpreter(results: dict) -> None:
    """The magic-number nibbles (2^23 + q, no int -> float) give the reference's bits: error 0."""
    cases = {name: err for name, err in results.items() if name.startswith("w4a16 dequant")}
    assert len(cases) == 2 and all(err == 0.0 for err in cases.values()), cases


def test_w4a16_gemv_split_fixup_under_interpreter(results: dict) -> None:
    """SPLIT_K 1, 2, 4, 8 on the GEMV kernel (plain and PIPE): the in-kernel sum matches the reference (float32 to
    ~1e-6, bf16 to its output rounding), a second call reusing the counters gives the same bits,
    and the counters are all 0 afterwards."""
    fixup = results["fixup"]
    assert len(fixup) == 20, fixup  # the GEMV, its pipelined K loop, and (16-bit) its scale-zero pairs
    bad = {name: r for name, r in fixup.items()
           if not (r["err"] < (1e-5 if "float32" in name else 1e-2) and r["same_bits"] and r["counters_zero"])}
    assert not bad, bad


def test_w4a16_gemv_scale_zero_pairs_same_bits_under_interpreter(results: dict) -> None:
    """The interleaved scales and zeros are detected as pairs (the separate tensors are not), and
    the GEMV reading them as one word gives the two tiles' bits."""
    same = results["pairs_same_bits"]
    assert len(same) == 4 and all(v == [True, False, True] for v in same.values()), same
