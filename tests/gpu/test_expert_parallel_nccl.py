"""Expert parallelism over 2 GPUs (NCCL all_to_all, the Triton MoE on each) equals one GPU
holding every expert: the MoE block alone (tests/unit/test_expert_parallel.py's cases)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_expert_parallel import SPLITS, run_two_ranks  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (e.g. nvidia-h100-x2)")]


@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: f"{s[0]}+{s[1]}tokens")
def test_two_gpus_nccl_equal_one_gpu(splits, tmp_path):
    # fp32 weights: the Triton GEMMs take full fp32 products (input_precision="ieee")
    run_two_ranks(splits, tmp_path, "nccl", "cuda:0", rtol=1e-4, atol=1e-5)
