"""The fused MoE Triton kernels on the CPU, under Triton's interpreter, against the reference.

TRITON_INTERPRET=1 must be set before triton is first imported, so the checks run in one child
process that reuses the `check_*` helpers of tests/gpu/test_fused_moe.py on small shapes and
prints one JSON object {case name: [relative error or bool, ok]}. fp32 and fp16 only: the
interpreter mis-multiplies bf16 in tl.dot (bf16 is covered on the GPU). Cases include experts
that get no token (skewed routing, more experts than entries), top_k == num_experts, a block
size larger than every expert's run, tails of K and N that are not tile multiples, and the
multi-chunk alignment path (more than SINGLE_MAX entries); one token through the GEMV path, with
its expert counters, a padding token and another rank's experts, and through the streaming GEMVs
(a program per tile, and 3 persistent programs walking several tiles each).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from interpreter_child import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "gpu" / "test_fused_moe.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHILD = r"""
res = {}
tile = lambda bn, bk, g: {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g, "num_warps": 4, "num_stages": 1}
small = {"BLOCK_M": 16, "up": tile(16, 16, 2), "down": tile(32, 16, 1)}
wide = {"BLOCK_M": 32, "up": tile(32, 32, 1), "down": tile(16, 32, 3)}
# (name, (tokens, experts, top_k, hidden, inter), skew, config)
cases = [
    ("decode t1 e16 k4", (1, 16, 4, 64, 48), False, small),
    ("t7 e8 k2 skewed", (7, 8, 2, 48, 40), True, small),
    ("t3 e4 k4 top_k == experts", (3, 4, 4, 32, 24), False, wide),
    ("t2 e32 k2 experts without tokens", (2, 32, 2, 32, 16), False, small),
    ("t40 e6 k3 K/N tails", (40, 6, 3, 72, 36), True, wide),
    ("t20 e8 k1", (20, 8, 1, 32, 32), False, small),
]
for dt, dname in ((f32, "fp32"), (f16, "fp16")):
    for i, (name, shape, skew, cfg) in enumerate(cases):
        err = checks.check_fused_moe(checks.make_case(*shape, dt, "cpu", seed=i, skew=skew), cfg)
        res[f"fused_moe {dname} {name}"] = [err, err < checks.TOL[dt]]
import minivllm.kernels.fused_moe as fm
fm.DECODE_STREAM = False  # one token: the two GEMV kernels (the streaming ones below)
for dt, dname in ((f32, "fp32"), (f16, "fp16")):  # one token: the two GEMV kernels
    for e, k, h, i, valid, elsewhere in [(16, 4, 64, 48, True, 0), (8, 2, 72, 36, False, 0), (8, 3, 40, 24, True, 2),
                                         (4, 4, 300, 20, True, 0), (8, 1, 64, 32, True, 0)]:  # (k 1: no fix-up)
        err, counted = checks.check_one_token(e, k, h, i, dt, "cpu", seed=e + k, valid=valid, elsewhere=elsewhere)
        res[f"one_token {dname} e{e} k{k} h{h} i{i} valid={valid} elsewhere={elsewhere}"] = [
            err, err < checks.TOL[dt] and counted]
fm.DECODE_STREAM = True  # the streaming one-token kernels: a full grid, and 3 persistent programs
for programs in (None, 3):
    fm.STREAM_TILES = {part: dict(t, programs=programs) for part, t in fm.STREAM_TILES.items()}
    for dt, dname in ((f32, "fp32"), (f16, "fp16")):
        for e, k, h, i, valid, elsewhere in [(16, 4, 64, 48, True, 0), (8, 3, 40, 24, True, 2), (4, 4, 300, 20, True, 0),
                                             (8, 1, 64, 32, False, 0)]:
            err, counted = checks.check_one_token(e, k, h, i, dt, "cpu", seed=e + k, valid=valid, elsewhere=elsewhere)
            res[f"one_token_stream {dname} programs={programs} e{e} k{k} h{h} i{i} valid={valid} "
                f"elsewhere={elsewhere}"] = [err, err < checks.TOL[dt] and counted]
fm.DECODE_STREAM = False
err = checks.check_fused_moe(checks.make_case(5, 8, 2, 32, 16, f32, "cpu", seed=9))  # the default config
res["fused_moe fp32 default config"] = [err, err < checks.TOL[f32]]
for t, e, k, bm in [(1, 16, 4, 16), (3, 4, 4, 4), (9, 64, 2, 16), (700, 8, 2, 16), (1500, 5, 2, 32)]:
    res[f"align t{t} e{e} k{k} bm{bm}"] = [None, checks.check_align(t, e, k, bm, "cpu", seed=t)]
for t, e, k in [(1, 16, 4), (9, 6, 2), (4, 5, 5)]:
    for renorm in (True, False):
        res[f"topk_softmax t{t} e{e} k{k} renorm={renorm}"] = [
            None, checks.check_topk_softmax(t, e, k, renorm, f32, "cpu", seed=t)]
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list]:
    return run_under_interpreter(CHILD, CHECKS, timeout_s=600)


@pytest.mark.parametrize("kernel", ["fused_moe", "one_token", "one_token_stream", "align", "topk_softmax"])
def test_moe_kernel_matches_reference_under_interpreter(interpreter_results: dict[str, list], kernel: str) -> None:
    cases = {name: r for name, r in interpreter_results.items() if name.startswith(kernel + " ")}
    assert cases, f"no {kernel} cases ran"
    bad = {name: r[0] for name, r in cases.items() if not r[1]}
    assert not bad, f"cases off the reference (relative error, or layout mismatch): {bad}"
