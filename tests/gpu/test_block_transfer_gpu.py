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


def check_block_copy(device: str, seed: int) -> dict:
    """kernels/block_copy.py on random pools: the target's K/V tensors plus two of another block
    size (a draft model's), random (src, dst) pairs in both directions between a device pool and a
    host pool (pinned on CUDA); every copied block equals its source in every tensor, nothing else
    changes. Returns {"ok": bool, "copied": pairs}."""
    from minivllm.kernels.block_copy import PoolTable, copy_blocks
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 2, 8)] * 6 + [(4, 1, 4)] * 2

    def pool(n, on):
        ts = [torch.randn(n, *s, generator=g).to(torch.bfloat16) for s in shapes]
        if on == "host" and device == "cuda":
            return [t.pin_memory() for t in ts]
        return [t.to(device) for t in ts]

    def copies_exactly(src, dst, src_ids, dst_ids) -> bool:
        """copy_blocks src -> dst; dst equals its old content with the copied blocks replaced."""
        want = [t.clone() for t in dst]
        for w, s in zip(want, src):
            w[dst_ids] = s[src_ids].to(w.device)
        copy_blocks(PoolTable(src, torch.device(device)), PoolTable(dst, torch.device(device)),
                    list(zip(src_ids, dst_ids)), torch.device(device))
        if device == "cuda":
            torch.cuda.synchronize()
        return all(torch.equal(d, w) for d, w in zip(dst, want))

    dev, host = pool(24, "device"), pool(12, "host")
    out_src = torch.randperm(24, generator=g)[:9].tolist()
    out_dst = torch.randperm(12, generator=g)[:9].tolist()
    in_src, in_dst = [0, 5, 6, 11], [23, 2, 3, 10]
    ok = copies_exactly(dev, host, out_src, out_dst)
    ok = copies_exactly(host, dev, in_src, in_dst) and ok
    return {"ok": bool(ok), "copied": len(out_src) + len(in_src)}


def test_block_copy_kernel_on_cuda():
    for seed in range(3):
        assert check_block_copy("cuda", seed)["ok"]


def test_many_scattered_blocks_take_the_kernel_and_copy_exactly():
    dev = [torch.randn(256, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(72)]
    block = sum(t[0].numel() * t.element_size() for t in dev)
    engine, _, _ = make_transfer_engine(dev, 0, 128 * block)
    src = torch.randperm(256)[:125].tolist()  # scattered: 125 runs x 72 tensors, the kernel's case
    want = [t[src].clone() for t in dev]
    engine.execute(KVTransfers(offload=[(s, i) for i, s in enumerate(src)]))
    engine.wait()
    for t in dev:
        t.zero_()
    dst = torch.randperm(256)[:125].tolist()
    engine.execute(KVTransfers(load=[(i, d) for i, d in enumerate(dst)]))
    engine.wait()
    for t, w in zip(dev, want):
        assert torch.equal(t[dst], w)
