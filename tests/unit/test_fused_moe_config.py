"""The fused MoE tile configuration: the sweep's JSON for this GPU (nearest token count, when
within a factor of two), or the default when the GPU or the shape has no entry near enough."""

from __future__ import annotations

import json

import pytest

from minivllm.kernels import fused_moe_config as fmc


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(fmc, "CONFIG_DIR", str(tmp_path))
    fmc.load_configs.cache_clear()
    fmc.pick_config.cache_clear()
    yield tmp_path
    fmc.load_configs.cache_clear()
    fmc.pick_config.cache_clear()


def _entry(block_m: int) -> dict:
    tile = {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": block_m, "up": tile, "down": tile}


def test_sweep_file_nearest_token_count(config_dir):
    key = fmc.shape_key(128, 768, 2048, "bfloat16")
    path = fmc.config_file("NVIDIA H100 80GB HBM3")
    assert path == str(config_dir / "NVIDIA_H100_80GB_HBM3.json")
    with open(path, "w") as f:
        json.dump({key: {"1": _entry(16), "64": _entry(32), "4096": _entry(128)}}, f)
    pick = lambda m: fmc.pick_config("NVIDIA H100 80GB HBM3", m, 128, 768, 2048, 8, "bfloat16")["BLOCK_M"]  # noqa: E731
    assert [pick(m) for m in (1, 40, 64, 3000)] == [16, 32, 32, 128]
    # no measured M within a factor of two: the default, not a decode or prefill tile stretched
    for m in (20, 1000, 16384):
        assert fmc.pick_config("NVIDIA H100 80GB HBM3", m, 128, 768, 2048, 8, "bfloat16") == fmc.default_config(m, 128, 8)
    assert pick(16384) == 64 != 128
    # another shape, dtype or GPU: the default
    assert fmc.pick_config("NVIDIA H100 80GB HBM3", 1, 8, 14336, 4096, 2, "bfloat16") == fmc.default_config(1, 8, 2)
    assert fmc.pick_config("NVIDIA A100-SXM4-80GB", 1, 128, 768, 2048, 8, "bfloat16") == fmc.default_config(1, 128, 8)
    # a Hopper sibling without its own table reads the H100's (tuned_tables.SIBLINGS)
    assert fmc.pick_config("NVIDIA H200", 1, 128, 768, 2048, 8, "bfloat16")["BLOCK_M"] == 16


def test_default_grows_blocks_with_rows_per_expert():
    sizes = [fmc.default_config(m, 128, 8)["BLOCK_M"] for m in (1, 256, 2048, 16384)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] == 64
    for m in (1, 16384):
        cfg = fmc.default_config(m, 128, 8)
        assert set(cfg) == {"BLOCK_M", "up", "down"}
        assert all(set(cfg[g]) == {"BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"} for g in ("up", "down"))
