"""The block transfer engine on random pools (CPU build: indexed copies): every copied block
equals its source in every tensor, nothing else changes, copies to the host come before copies
to the device, and runs of consecutive ids coalesce."""

from __future__ import annotations

import torch

from minivllm.core.interfaces import KVTransfers
from minivllm.kv_transfer.block_transfer import BlockTransferEngine, coalesce, make_transfer_engine


def _pool(num_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, 4, 2, 8, generator=g) for _ in range(6)]  # 3 layers' K and V


def test_coalesce_runs():
    assert coalesce([(3, 7), (4, 8), (5, 9), (9, 0), (10, 2), (11, 3)]) == [(3, 7, 3), (9, 0, 1), (10, 2, 2)]
    assert coalesce([]) == []


def test_random_block_lists_copy_exactly():
    dev, swap, off = _pool(32, 0), _pool(16, 1), _pool(8, 2)
    engine = BlockTransferEngine(dev, {"swap": swap, "offload": off})
    g = torch.Generator().manual_seed(3)
    out_src = torch.randperm(32, generator=g)[:10].tolist()
    out_dst = torch.randperm(16, generator=g)[:10].tolist()
    load_src, load_dst = [1, 2, 3], [out_src[0], 30, 31]  # one device block leaves and is refilled
    before_dev = [t.clone() for t in dev]
    before_off = [t.clone() for t in off]
    engine.execute(KVTransfers(swap_out=list(zip(out_src, out_dst)), load=list(zip(load_src, load_dst))))
    for t, b in zip(swap, before_dev):
        assert torch.equal(t[out_dst], b[out_src])  # the swap pool got the old content
    for t, b in zip(dev, before_off):
        assert torch.equal(t[load_dst], b[load_src])
    untouched = [i for i in range(32) if i not in load_dst]
    for t, b in zip(dev, before_dev):
        assert torch.equal(t[untouched], b[untouched])
    assert engine.bytes_moved == 13 * engine.block_bytes == 13 * 6 * 4 * 2 * 8 * 4


def test_swap_round_trip_restores_blocks_elsewhere():
    dev, swap = _pool(16, 4), _pool(8, 5)
    engine = BlockTransferEngine(dev, {"swap": swap})
    kept = [t[[2, 3, 9]].clone() for t in dev]
    engine.execute(KVTransfers(swap_out=[(2, 0), (3, 1), (9, 2)]))
    for t in dev:
        t.zero_()  # the device blocks are reused meanwhile
    engine.execute(KVTransfers(swap_in=[(0, 11), (1, 12), (2, 5)]))
    for t, k in zip(dev, kept):
        assert torch.equal(t[[11, 12, 5]], k)


def test_make_transfer_engine_sizes_pools_in_whole_blocks():
    dev = _pool(4, 6)
    block = sum(t[0].numel() * t.element_size() for t in dev)
    engine, num_swap, num_offload = make_transfer_engine(dev, 3 * block + 1, block - 1)
    assert (num_swap, num_offload) == (3, 0) and set(engine.host_pools) == {"swap"}
    assert engine.host_pools["swap"][0].shape == (3, 4, 2, 8)
    assert make_transfer_engine(dev, 0, 0)[0] is None
