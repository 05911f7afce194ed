"""The dense batch-1 GEMV under Triton's interpreter on the CPU (the checks of
tests/gpu/test_dense_gemv.py, in one child process), and which layers take it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from interpreter_child import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "gpu" / "test_dense_gemv.py"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHILD = r"""
res = {}
tile = {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2, "num_stages": 1}
# ragged N (last tile partly past N), K not a multiple of BLOCK_K, split-K with idle slices
# (K = 128 is 2 slices: split 4 leaves two programs a zero partial), bias with split-K (added once),
# strided x rows, fp16
for name, m, n, k, dt, split, bias, xs in [
        ("m1 even", 1, 32, 128, f32, 1, False, 0),
        ("m1 ragged n", 1, 37, 128, f32, 1, False, 0),
        ("m1 ragged k", 1, 32, 100, f32, 1, False, 0),
        ("m2 split2 bias", 2, 45, 256, f32, 2, True, 0),
        ("m1 split4 idle slices", 1, 40, 128, f32, 4, True, 0),
        ("m2 split8 ragged k strided", 2, 21, 300, f32, 8, False, 7),
        ("m1 split2 fp16", 1, 48, 192, f16, 2, True, 0)]:
    res[name] = checks.check_dense_gemv(m, n, k, dt, "cpu", tile, split, bias=bias, seed=n + k, x_stride=xs)
# the split-K counters are reset by the last program: a second call with the same grid is right too
res["again split4"] = checks.check_dense_gemv(1, 40, 128, f32, "cpu", tile, 4, bias=True, seed=3)
res.update({"linear " + k: v for k, v in checks.check_gemv_linear_rows("cpu", f32).items()})
# the streaming kernel: a program per tile, and 3 or 5 persistent programs over several tiles (ragged
# N, K below its power of two), fp16
for name, n, k, dt, tile in [
        ("stream ragged", 37, 100, f32, {"BLOCK_N": 2, "num_warps": 2, "programs_per_sm": 2}),
        ("stream persistent", 45, 256, f32, {"BLOCK_N": 4, "num_warps": 2, "programs": 3}),
        ("stream fp16", 64, 192, f16, {"BLOCK_N": 2, "num_warps": 2, "programs": 5})]:
    res[name] = checks.check_dense_gemv_stream(n, k, dt, "cpu", tile, bias=True, seed=n)
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def results() -> dict[str, float]:
    return run_under_interpreter(CHILD, CHECKS, timeout_s=600)


@needs_triton
def test_dense_gemv_matches_reference_under_interpreter(results: dict[str, float]) -> None:
    assert len(results) == 15
    for name, err in results.items():
        tol = 2e-3 if "fp16" in name else 1e-5
        assert err < tol, (name, err)


# ---------------------------------------------------------------- which layers take the GEMV


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A sweep table for a made-up GPU: one shape faster as a GEMV, one slower."""
    from minivllm.kernels import dense_gemv as dg
    monkeypatch.setattr(dg, "CONFIG_DIR", str(tmp_path))
    dg.load_configs.cache_clear()
    tile = {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3, "SPLIT_K": 2}
    data = {dg.shape_key(5120, 2048, torch.bfloat16): {"tile": tile, "gemv_us": 8.0, "cublas_us": 12.0},
            dg.shape_key(28672, 4096, torch.bfloat16): {"tile": tile, "gemv_us": 90.0, "cublas_us": 81.0}}
    Path(dg.config_file("Test GPU 80GB")).write_text(json.dumps(data))
    yield dg
    dg.load_configs.cache_clear()


def test_pick_tile_follows_the_sweep(table, monkeypatch) -> None:
    dg = table
    monkeypatch.delenv("MINIVLLM_DENSE_GEMV", raising=False)
    mode = dg.gemv_mode()
    assert mode == "auto"
    assert dg.pick_tile(5120, 2048, torch.bfloat16, "Test GPU 80GB", mode)["BLOCK_N"] == 8  # faster: taken
    assert dg.pick_tile(28672, 4096, torch.bfloat16, "Test GPU 80GB", mode) is None  # slower: cuBLAS
    assert dg.pick_tile(999, 64, torch.bfloat16, "Test GPU 80GB", mode) is None  # not measured: cuBLAS
    assert dg.pick_tile(5120, 2048, torch.float16, "Test GPU 80GB", mode) is None  # another dtype
    assert dg.pick_tile(5120, 2048, torch.bfloat16, "Other GPU", mode) is None  # no table for that GPU
    assert dg.pick_tile(28672, 4096, torch.bfloat16, "Test GPU 80GB", "on")["SPLIT_K"] == 2  # forced
    assert dg.pick_tile(999, 64, torch.bfloat16, "Other GPU", "on") == dg.DEFAULT_TILE
    assert dg.pick_tile(5120, 2048, torch.bfloat16, "Test GPU 80GB", "off") is None
    for value, want in [("1", "on"), ("0", "off"), ("auto", "auto"), ("", "auto")]:
        monkeypatch.setenv("MINIVLLM_DENSE_GEMV", value)
        assert dg.gemv_mode() == want


def test_the_kept_tables_name_real_shapes() -> None:
    """Every kept sweep table parses, and its tiles are ones the kernel takes."""
    from minivllm.kernels import dense_gemv as dg
    tables = sorted(Path(dg.CONFIG_DIR).glob("*.json")) if Path(dg.CONFIG_DIR).is_dir() else []
    if not tables:
        pytest.skip("no sweep table kept yet (scripts/bench_dense_gemv.py --write on a GPU)")
    for path in tables:
        for key, entry in json.loads(path.read_text()).items():
            assert key.startswith("N=") and ",K=" in key, key
            assert set(entry["tile"]) >= {"BLOCK_N", "BLOCK_K", "num_warps"}, (path, key)
            assert entry["gemv_us"] > 0 and entry["cublas_us"] > 0
