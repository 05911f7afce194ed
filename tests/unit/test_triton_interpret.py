"""The Triton attention kernels on the CPU, under Triton's interpreter, against the reference.

TRITON_INTERPRET=1 must be set before triton is first imported, so the checks run in one
child process (this pytest process may already have imported triton). The child reuses the
case builders and checks of tests/gpu/test_triton_kernels.py on small shapes and prints one
JSON object {case name: [overall error, worst-row error, ok]}. The interpreter mis-multiplies bf16 in tl.dot
(it keeps bf16 as raw uint16), so these run in fp32 and fp16; bf16 is covered on the GPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from interpreter_child import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ROOT / "tests" / "gpu" / "test_triton_kernels.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# Run in the child. (q_len, seq_len) per sequence; heads as (num_heads, num_kv_heads).
CHILD = r"""

def case(specs, heads, head_dim, block_size, dtype, seed, pad_tokens=0):
    return checks.make_case(specs, heads[0], heads[1], head_dim, block_size, dtype, "cpu", seed, pad_tokens)

res = {}  # name -> [overall relative error, worst row relative error, within tolerance]

def record(name, dtype, errs):
    res[name] = [errs[0], errs[1], checks.ok(errs, dtype)]

# (10, 72): the tile's first row sees key 62 but not 63, right at a BLOCK_N boundary
mixed = [(37, 60), (1, 45), (20, 20), (5, 90), (1, 1), (10, 72), (64, 64)]
decode = [(1, 60), (1, 1), (1, 97), (1, 17), (1, 300)]
record("store_kv fp16 bs16", f16, checks.check_store_kv(case(mixed, (8, 4), 64, 16, f16, 1)))
record("store_kv fp32 bs32", f32, checks.check_store_kv(case(mixed, (8, 2), 128, 32, f32, 2)))
record("prefill fp32 d64 gqa1 bs16", f32,
       checks.check_prefill(case(mixed + [(150, 230)], (4, 4), 64, 16, f32, 3, pad_tokens=3)))
record("prefill fp16 d128 gqa4 bs32", f16, checks.check_prefill(case(mixed, (8, 2), 128, 32, f16, 4)))
record("prefill fp32 d64 gqa4 invariant", f32, checks.check_prefill(case(mixed, (12, 4), 64, 16, f32, 14), invariant=True))
# 16-bit heads of <= 128 take batch-invariant mode's own launch (128 keys a tile, 3 stages)
record("prefill fp16 d128 gqa2 invariant", f16, checks.check_prefill(case(mixed, (8, 4), 128, 16, f16, 15), invariant=True))
# the row sums on the tensor cores (softmax_accumulate's ROWSUM_MMA), 64- and 16-row tiles
record("prefill fp16 d128 gqa2 invariant rowsum-mma", f16, checks.check_prefill(
    case(mixed, (8, 4), 128, 16, f16, 16), invariant=True, config={"BLOCK_M": 64, "ROWSUM_MMA": True}))
record("prefill fp32 d64 gqa4 rowsum-mma", f32, checks.check_prefill(
    case(mixed, (12, 4), 64, 16, f32, 17), invariant=True, config={"BLOCK_M": 16, "ROWSUM_MMA": True}))
record("prefill fp32 d128 gqa4 decode-only", f32, checks.check_prefill(case(decode, (8, 2), 128, 16, f32, 5)))
record("decode fp32 d64 gqa1 bs16 auto", f32, checks.check_decode(case(decode, (4, 4), 64, 16, f32, 6)))
record("decode fp16 d128 gqa4 bs32 auto", f16, checks.check_decode(case(decode, (8, 2), 128, 32, f16, 7)))
record("decode fp32 d128 gqa4 1 split", f32, checks.check_decode(case(decode, (8, 2), 128, 16, f32, 8), num_splits=1))
record("decode fp32 d64 gqa4 3 splits ws8", f32,
       checks.check_decode(case(decode, (8, 2), 64, 16, f32, 9), num_splits=3, workspace_splits=8))
# stage 2 by the last stage-1 program (the default) vs the merge kernel: 4 and 8 chunks, one sequence of one key
for splits, dt in ((4, f32), (8, f16)):
    merged = checks.check_decode_merge_modes(case(decode, (8, 2), 64, 16, dt, 18), splits)
    res[f"merge {splits} splits {str(dt)[6:]}"] = [merged["in_split"][0], merged["kernel"][0], merged["apart"],
                                                    checks.ok(merged["in_split"], dt) and checks.ok(merged["kernel"], dt),
                                                    merged["counters_zero"]]
# the same with every program storing a partial and counting (MINIVLLM_DECODE_SKIP_EMPTY=0)
import os
os.environ["MINIVLLM_DECODE_SKIP_EMPTY"] = "0"
merged = checks.check_decode_merge_modes(case(decode, (8, 2), 64, 16, f32, 18), 4)
del os.environ["MINIVLLM_DECODE_SKIP_EMPTY"]
res["merge 4 splits float32 no skip"] = [merged["in_split"][0], merged["kernel"][0], merged["apart"],
                                         checks.ok(merged["in_split"], f32), merged["counters_zero"]]
record("split fp32 d64 gqa4 mixed 1 split", f32, checks.check_split_roles(case(mixed, (8, 2), 64, 16, f32, 12), 1))
record("split fp16 d128 gqa2 mixed 3 splits", f16,
       checks.check_split_roles(case(mixed + [(1, 300)], (4, 2), 128, 32, f16, 13, pad_tokens=2), 3))
record("backend fp32 mixed", f32, checks.check_backend(case(mixed, (8, 2), 64, 16, f32, 10)))
record("backend fp32 decode", f32, checks.check_backend(case(decode, (8, 2), 64, 16, f32, 11)))
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list]:
    return run_under_interpreter(CHILD, KERNEL_TESTS, timeout_s=600)


@pytest.mark.parametrize("kernel", ["store_kv", "prefill", "decode", "split", "backend"])
def test_kernel_matches_reference_under_interpreter(interpreter_results: dict[str, list], kernel: str) -> None:
    cases = {name: r for name, r in interpreter_results.items() if name.startswith(kernel + " ")}
    assert cases, f"no {kernel} cases ran"
    bad = {name: r[:2] for name, r in cases.items() if not r[2]}
    assert not bad, f"(overall, worst-row) relative error too large (inf: NaN in output or store mismatch): {bad}"


def test_decode_merge_in_split_under_interpreter(interpreter_results: dict[str, list]) -> None:
    """The chunks merged by the last stage-1 program: within tolerance of the reference, as the
    merge kernel is, the two within rounding of each other, and the counters back at 0; with
    the empty chunks' programs exiting (the default) and with them storing and counting."""
    cases = {name: r for name, r in interpreter_results.items() if name.startswith("merge ")}
    assert len(cases) == 3, cases
    bad = {name: r for name, r in cases.items() if not (r[3] and r[2] < (1e-5 if "float32" in name else 1e-3) and r[4])}
    assert not bad, bad
