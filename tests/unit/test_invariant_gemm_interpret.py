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
res["fp32 m9 n600 k64 (64-wide tiles)"] = checks.check_matmul(9, 600, 64, f32, "cpu", seed=4, bias=True, bitwise=False)
res["fp32 m3 n4300 k64 (128-wide tiles)"] = checks.check_matmul(3, 4300, 64, f32, "cpu", seed=5, bias=False, bitwise=False)
# narrow weights split K (split_k_for): 2 slices with a ragged last K tile and a bias added once;
# 4 slices, twice in a row (the split-K counters are back to 0 after each call)
res["fp32 m5 n200 k1100 bias (2 K slices)"] = checks.check_matmul(5, 200, 1100, f32, "cpu", seed=6, bias=True, bitwise=False)
for rep in range(2):
    res[f"fp32 m70 n96 k2048 (4 K slices) #{rep}"] = checks.check_matmul(70, 96, 2048, f32, "cpu", seed=7, bias=True,
                                                                      bitwise=False)
# the K slices walked in one program and summed in order: the split-K fix-up's bits (same tiles,
# so the interpreter's numpy products are the same too)
for m, n, k, split_tile in [(5, 200, 1100, (64, 32, 64, 4, 3)), (70, 96, 2048, (16, 32, 64, 4, 3))]:
    res[f"fp32 m{m} n{n} k{k} in one program"] = checks.check_launches(m, n, k, f32, "cpu", seed=8, bias=True,
                                                                      launches=[(split_tile, True)], base_tile=split_tile)
print("RESULT " + json.dumps(res))
"""


def test_invariant_matmul_under_interpreter():
    res = run_under_interpreter(CHILD, CHECKS, timeout_s=600)
    assert len(res) == 10
    bad = {name: problems for name, problems in res.items() if problems}
    assert not bad, bad


def test_k_split_depends_on_the_weight_only(monkeypatch):
    """split_k_for: a function of N, K and the SM count; only narrow weights split, each slice
    keeps at least SPLIT_MIN_K_PER_SLICE of K, and the tuning override turns it off."""
    from minivllm.kernels import invariant_gemm as ig
    monkeypatch.delenv(ig.TILE_ENV, raising=False)
    # Qwen3-0.6B: qkv, o, gate_up, down; then Qwen3-8B's o (wide enough) and a short K
    got = [ig.split_k_for(n, k, 132) for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
                                                   (4096, 4096), (1024, 512)]]
    assert got == [1, 4, 1, 4, 1, 1]
    for n, k in [(1024, 2048), (576, 1536), (200, 1100)]:
        split = ig.split_k_for(n, k, 132)
        assert split == 1 or k // split >= ig.SPLIT_MIN_K_PER_SLICE, (n, k, split)
    monkeypatch.setenv(ig.TILE_ENV, "64,128,64,4,3")
    assert ig.split_k_for(1024, 3072, 132) == 1


def test_tile_width_depends_on_the_weight_only(monkeypatch):
    """block_n_for: a function of N and the SM count (never of the rows), narrow weights get
    narrow tiles so a 256-row batch fills the GPU; the tuning override fixes one tile."""
    from minivllm.kernels import invariant_gemm as ig
    monkeypatch.delenv(ig.TILE_ENV, raising=False)
    assert [ig.block_n_for(n, 132) for n in (1024, 4096, 6144, 151936)] == [32, 64, 128, 128]
    for n in (1024, 4096, 6144):  # each choice gives a 4-row-tile batch at least an SM's worth
        bn = ig.block_n_for(n, 132)
        assert ig.REFERENCE_ROW_TILES * -(-n // bn) >= 132 or bn == ig.BLOCK_N_CHOICES[-1]
    monkeypatch.setenv(ig.TILE_ENV, "64,128,64,4,3")
    assert ig.block_n_for(1024, 132) == ig.BLOCK_N


def test_launch_table_buckets_and_kept_table():
    """bucket_launch: the first bucket holding the rows, the last beyond; the kept tables
    (kernels/configs/invariant_gemm/) are well-formed: rising row buckets, tiles the kernel
    compiles (power-of-two sides, MMA-sized), and the CPU never reads them."""
    import json
    from pathlib import Path

    import torch

    from minivllm.kernels import invariant_gemm as ig
    buckets = [[1, [16, 32, 128, 4, 4], False], [256, [64, 32, 64, 4, 4], True], [2048, [128, 64, 64, 8, 3], True]]
    assert ig.bucket_launch(buckets, 1) == ((16, 32, 128, 4, 4), False)
    assert ig.bucket_launch(buckets, 2) == ((64, 32, 64, 4, 4), True)
    assert ig.bucket_launch(buckets, 256) == ((64, 32, 64, 4, 4), True)
    assert ig.bucket_launch(buckets, 257) == ((128, 64, 64, 8, 3), True)
    assert ig.bucket_launch(buckets, 100000) == ((128, 64, 64, 8, 3), True)
    tables = list(Path(ig.CONFIG_DIR).glob("*.json"))
    assert tables, "no kept launch table"
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    for path in tables:
        for key, entry in json.loads(path.read_text()).items():
            assert entry.get("split_k", 1) in (1, 2, 4, 8), key
            rows = [r[0] for r in entry["rows"]]
            assert rows == sorted(set(rows)), (path.name, key)
            for _, (bm, bn, bk, warps, stages), in_program in entry["rows"]:
                assert bm in (16, 32, 64, 128) and pow2(bn) and 16 <= bn <= 256 and bk in (32, 64, 128, 256), key
                assert warps in (4, 8) and 2 <= stages <= 5 and isinstance(in_program, bool), key
    assert ig.table_entry(1024, 2048, torch.device("cpu")) is None
    assert ig.invariant_matmul(torch.empty(0, 64), torch.empty(32, 64)).shape == (0, 32)  # no rows: no launch
    assert ig.launch_for(1024, 2048, 256, torch.device("cpu"))[1] is False
    # a table's K slice count replaces the derived one for its weight only
    assert ig.split_k_for(1024, 2048, 132, {"split_k": 2, "rows": buckets}) == 2
    assert ig.split_k_for(1024, 2048, 132, {"rows": buckets}) == ig.split_k_for(1024, 2048, 132) == 4


def test_table_env_names_another_table(monkeypatch, tmp_path):
    """MINIVLLM_INVARIANT_GEMM_TABLE=<file>.json reads that table instead of the GPU's kept one
    (A/B runs against an earlier sweep); any other value keeps the kept table."""
    import json

    from minivllm.kernels import invariant_gemm as ig
    from minivllm.kernels import tuned_tables
    other = tmp_path / "old.json"
    other.write_text(json.dumps({"N=1024,K=2048": {"split_k": 4, "rows": [[1, [16, 32, 128, 4, 4], False]]}}))
    monkeypatch.setenv(ig.TABLE_ENV, str(other))
    ig.launch_table.cache_clear()
    try:
        assert ig.launch_table("NVIDIA H100 80GB HBM3")["N=1024,K=2048"]["split_k"] == 4
        monkeypatch.setenv(ig.TABLE_ENV, "1")
        ig.launch_table.cache_clear()
        kept = tuned_tables.read_table(tuned_tables.table_file(ig.CONFIG_DIR, "NVIDIA H100 80GB HBM3"))
        assert ig.launch_table("NVIDIA H100 80GB HBM3") == kept
        assert kept["N=1024,K=2048"]["split_k"] == 1  # lease 31's sweep: one K slice for o_proj
    finally:
        ig.launch_table.cache_clear()
