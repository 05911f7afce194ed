"""The block transfer engine on the GPU: copies on its own stream to and from pinned host pools,
ordered after the compute stream's writes and before its next reads (no host wait)."""

from __future__ import annotations

import pytest
import torch

from minivllm.core.interfaces import KVTransfers
from minivllm.kv_transfer.block_transfer import make_transfer_engine

pytestmark = pytest.mark.gpu


def test_swap_and_load_round_trip_on_cuda():
    dev = [torch.randn(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    block = sum(t[0].numel() * t.element_size() for t in dev)
    engine, num_swap, num_offload = make_transfer_engine(dev, 32 * block, 16 * block)
    assert (num_swap, num_offload) == (32, 16) and engine.host_pools["swap"][0].is_pinned()
    src = [3, 4, 5, 6, 20, 40, 41]
    for t in dev:
        t[src] += 1.0  # a compute-stream write the copy out must see
    want = [t[src].clone() for t in dev]
    engine.execute(KVTransfers(swap_out=[(s, i) for i, s in enumerate(src)], offload=[(3, 0), (4, 1)]))
    engine.wait()
    for t in dev:
        t[src] = 0  # queued on the compute stream after the copies (wait), so they read the old values
    dst = [10, 11, 12, 13, 50, 51, 52]
    engine.execute(KVTransfers(swap_in=[(i, d) for i, d in enumerate(dst)], load=[(0, 60), (1, 61)]))
    engine.wait()
    for t, w in zip(dev, want):
        assert torch.equal(t[dst], w)
        assert torch.equal(t[[60, 61]], w[:2])
