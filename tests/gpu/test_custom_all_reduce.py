"""The symmetric-memory all-reduce (distributed/symm_all_reduce.py) on 2 and 4 GPUs: one-shot and
two-shot kernels, bf16 and fp32, equal bit for bit to the rank-order sum and the same on every
rank, also replayed from a CUDA graph; decode sizes routed to them, larger messages to NCCL
(minivllm.bench.all_reduce_bench's checks)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world", [2, 4])
def test_kernels_equal_rank_order_sum(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    from minivllm.bench.all_reduce_bench import run
    result = run(world, check_only=True)
    assert result["custom_built"], "symmetric memory could not be set up (see the log)"
    assert result["failures"] == []
