"""Which kept sweep table a GPU reads (kernels/tuned_tables.py): its own, else its sibling's, else none."""

from __future__ import annotations

import json

import pytest

from minivllm.kernels import tuned_tables


@pytest.fixture
def config_dir(tmp_path):
    (tmp_path / "NVIDIA_H100_80GB_HBM3.json").write_text(json.dumps({"N=8,K=8": {"from": "h100"}}))
    (tmp_path / "NVIDIA_A100-SXM4-80GB.json").write_text(json.dumps({"N=8,K=8": {"from": "a100"}}))
    return str(tmp_path)


def test_own_table_first(config_dir, tmp_path):
    (tmp_path / "NVIDIA_H200.json").write_text(json.dumps({"N=8,K=8": {"from": "h200"}}))
    assert tuned_tables.device_table(config_dir, "NVIDIA H200")["N=8,K=8"]["from"] == "h200"
    assert tuned_tables.device_table(config_dir, "NVIDIA H100 80GB HBM3")["N=8,K=8"]["from"] == "h100"


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H800", "NVIDIA GH200 480GB"])
def test_hopper_without_a_table_borrows_the_h100s(config_dir, name, caplog):
    with caplog.at_level("INFO", logger=tuned_tables.__name__):
        assert tuned_tables.device_table(config_dir, name)["N=8,K=8"]["from"] == "h100"
    assert "NVIDIA H100 80GB HBM3" in caplog.text and name in caplog.text


@pytest.mark.parametrize("name", ["NVIDIA A100-SXM4-40GB", "NVIDIA L40S", "NVIDIA H20", "Test GPU"])
def test_other_gpus_without_a_table_get_none(config_dir, name):
    assert tuned_tables.device_table(config_dir, name) == {}


def test_no_sibling_table_kept(tmp_path):
    assert tuned_tables.device_table(str(tmp_path), "NVIDIA H200") == {}


def test_every_kept_kernel_table_reaches_the_h200():
    """The shipped tables: each kernel kept for the H100 is what an H200 without its own reads."""
    import os

    from minivllm.kernels import dense_gemv, fused_moe_config, invariant_gemm, w4a16_gemm
    for config_dir in (w4a16_gemm.GEMV_CONFIG_DIR, dense_gemv.CONFIG_DIR, fused_moe_config.CONFIG_DIR,
                       invariant_gemm.CONFIG_DIR):
        h100 = tuned_tables.read_table(tuned_tables.table_file(config_dir, "NVIDIA H100 80GB HBM3"))
        assert h100, config_dir
        if not os.path.isfile(tuned_tables.table_file(config_dir, "NVIDIA H200")):
            assert tuned_tables.device_table(config_dir, "NVIDIA H200") == h100, config_dir


def test_tiled_launch_takes_the_nearest_kept_row_count_at_or_above(monkeypatch):
    """w4a16_gemm.tiled_launch: the kept entry whose max_rows is the first >= M (above the last:
    the last); a weight without an entry, or the CPU, keeps W4A16_CONFIGS and no fixed split."""
    import torch

    from minivllm.kernels import w4a16_gemm as w4k
    small = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    large = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    table = {"N=4096,K=4096,G=128": {"rows": [[32, small, 4, 10.0, 50.0], [128, large, 1, 30.0, 60.0]]}}
    monkeypatch.setattr(w4k, "tiled_table", lambda name: table)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H200")
    cuda = torch.device("cuda")
    assert w4k.tiled_launch(3, 4096, 4096, 128, cuda) == (small, 4)
    assert w4k.tiled_launch(32, 4096, 4096, 128, cuda) == (small, 4)
    assert w4k.tiled_launch(33, 4096, 4096, 128, cuda) == (large, 1)
    assert w4k.tiled_launch(200, 4096, 4096, 128, cuda) == (large, 1)
    assert w4k.tiled_launch(64, 6144, 4096, 128, cuda) == (w4k.w4a16_config(64), None)
    assert w4k.tiled_launch(64, 4096, 4096, 128, torch.device("cpu")) == (w4k.w4a16_config(64), None)


def test_dense_choice_follows_the_kept_timings(monkeypatch):
    """w4a16_gemm.dense_beats_kernel: dequant + cuBLAS for the rows of a weight whose kept entry
    timed it faster than the kernel, above half that entry's row count; never where the kernel
    won, on the CPU, for a weight without an entry, or with the switch off."""
    import torch

    from minivllm.kernels import w4a16_gemm as w4k
    cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    table = {"N=4096,K=4096,G=128": {"rows": [[32, cfg, 4, 20.0, 60.0], [128, cfg, 4, 33.3, 30.9]]},
             "N=6144,K=4096,G=128": {"rows": [[32, cfg, 4, 30.0, 150.0], [128, cfg, 2, 40.0, 45.0]]}}
    monkeypatch.setattr(w4k, "tiled_table", lambda name: table)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H200")
    cuda = torch.device("cuda")
    assert [m for m in (3, 32, 33, 64, 65, 128, 200) if w4k.dense_beats_kernel(m, 4096, 4096, 128, cuda)] == [65, 128,
                                                                                                             200]
    assert not any(w4k.dense_beats_kernel(m, 6144, 4096, 128, cuda) for m in (3, 64, 128, 200))
    assert not w4k.dense_beats_kernel(128, 4096, 14336, 128, cuda)
    assert not w4k.dense_beats_kernel(128, 4096, 4096, 128, torch.device("cpu"))
    monkeypatch.setattr(w4k, "DENSE_CHOICE", False)
    assert not w4k.dense_beats_kernel(128, 4096, 4096, 128, cuda)


def test_kept_tiled_tables_are_well_formed_and_reach_the_h100():
    """The shipped several-row W4A16 tables (configs/w4a16_tiled/): rising row counts, launches the
    kernel takes; an H100, which has none of its own, reads the H200's."""
    import glob
    import os

    from minivllm.kernels import w4a16_gemm as w4k
    paths = glob.glob(os.path.join(w4k.TILED_CONFIG_DIR, "*.json"))
    assert paths
    for path in paths:
        for key, entry in tuned_tables.read_table(path).items():
            bounds = [row[0] for row in entry["rows"]]
            assert bounds == sorted(set(bounds)) and bounds[0] > w4k.W4A16_CONFIGS[0][0], key
            for _, cfg, split, us, dense_us in entry["rows"]:
                assert cfg["BLOCK_M"] in (16, 32, 64, 128) and cfg["BLOCK_N"] in (32, 64, 128, 256), key
                assert cfg["BLOCK_K"] in (32, 64, 128, 256) and set(cfg) == {"BLOCK_M", "BLOCK_N", "BLOCK_K",
                                                                             "num_warps", "num_stages"}, key
                assert split in (1, 2, 4, 8, 16) and us > 0 and dense_us > 0, key
    if not os.path.isfile(tuned_tables.table_file(w4k.TILED_CONFIG_DIR, "NVIDIA H100 80GB HBM3")):
        h200 = tuned_tables.read_table(tuned_tables.table_file(w4k.TILED_CONFIG_DIR, "NVIDIA H200"))
        assert tuned_tables.device_table(w4k.TILED_CONFIG_DIR, "NVIDIA H100 80GB HBM3") == h200
