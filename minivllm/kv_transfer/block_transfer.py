"""Batched copies of lists of KV blocks between the device KV pool and host pools.

Every pool is a list of per-layer tensors [num_blocks, block_size, Hkv, D] (K and V of each
layer, then a draft model's, in one flat list), the same layout on both sides, so a block
copy is the same row of every tensor.

- CPU build: one indexed copy per tensor (dst[dst_ids] = src[src_ids]).
- CUDA: runs of consecutive (src, dst) ids are coalesced; a few runs become slice copies (the
  copy engines), many become one launch of kernels/block_copy.py (every block of every tensor,
  through the pinned host pools' device addresses: one cudaMemcpyAsync per run and tensor
  would be ~9,000 host calls for a 2,000-token Qwen3-8B prefix). Either is queued without
  waiting on the engine's own stream; that stream first waits for the compute stream (a copy
  out must see the K/V of steps queued before it), and the compute stream waits for the copies
  (`wait`) before the step's forward reads or overwrites them.
"""

from __future__ import annotations

import torch

from minivllm.core.interfaces import BlockPairs, KVTransfers

# at most this many slice copies (runs x tensors) a transfer; more: one block-copy kernel launch
MAX_SLICE_COPIES = 64


def coalesce(pairs: BlockPairs) -> list[tuple[int, int, int]]:
    """(src, dst, length) runs: consecutive pairs whose ids both go up by one, in their order."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            s, d, n = runs[-1]
            runs[-1] = (s, d, n + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def allocate_host_pool(like: list[torch.Tensor], num_blocks: int, pin: bool) -> list[torch.Tensor]:
    """A host pool of num_blocks blocks shaped like the device pool `like`."""
    return [torch.zeros((num_blocks, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin) for t in like]


class BlockTransferEngine:
    """Copies blocks between a device pool and named host pools ("swap", "offload")."""

    def __init__(self, device_pool: list[torch.Tensor], host_pools: dict[str, list[torch.Tensor]]) -> None:
        self.device_pool = device_pool
        self.host_pools = host_pools
        self.device = device_pool[0].device
        self.on_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.event: torch.cuda.Event | None = None  # recorded after the last queued copies
        self.bytes_moved = 0
        self.block_bytes = sum(t[0].numel() * t.element_size() for t in device_pool)
        self._tables: dict[int, object] = {}  # id(pool) -> kernels.block_copy.PoolTable (CUDA)

    def execute(self, transfers: KVTransfers) -> None:
        """Queue a step's copies: every copy to the host, then every copy to the device."""
        ops = [(transfers.swap_out, "swap", True), (transfers.offload, "offload", True),
               (transfers.swap_in, "swap", False), (transfers.load, "offload", False)]
        if self.on_cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._copy_all(ops)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        else:
            self._copy_all(ops)

    def _copy_all(self, ops: list[tuple[BlockPairs, str, bool]]) -> None:
        for pairs, pool, to_host in ops:
            if not pairs:
                continue
            host = self.host_pools[pool]
            src, dst = (self.device_pool, host) if to_host else (host, self.device_pool)
            self.copy_blocks(src, dst, pairs)
            self.bytes_moved += len(pairs) * self.block_bytes

    def copy_blocks(self, src: list[torch.Tensor], dst: list[torch.Tensor], pairs: BlockPairs) -> None:
        """dst[d] = src[s] for every (s, d) pair, in every tensor of the pools."""
        if not self.on_cuda:
            src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
            dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
            for s, d in zip(src, dst):
                d.index_copy_(0, dst_ids, s.index_select(0, src_ids))
            return
        runs = coalesce(pairs)
        if len(runs) * len(src) > MAX_SLICE_COPIES:
            src_table, dst_table = self._table(src), self._table(dst)
            if src_table is not None and dst_table is not None:
                from minivllm.kernels.block_copy import copy_blocks
                copy_blocks(src_table, dst_table, pairs, self.device)
                return
        for s, d in zip(src, dst):
            for a, b, n in runs:
                d[b:b + n].copy_(s[a:a + n], non_blocking=True)

    def _table(self, pool: list[torch.Tensor]):
        """The pool's kernels.block_copy.PoolTable, or None where the kernel cannot read it
        (a layout of partial words or strides): its copies then stay slice copies."""
        if id(pool) not in self._tables:
            from minivllm.kernels.block_copy import PoolTable
            try:
                self._tables[id(pool)] = PoolTable(pool, self.device)
            except ValueError:
                self._tables[id(pool)] = None
        return self._tables[id(pool)]

    def wait(self) -> None:
        """The compute stream waits for the copies queued so far (no host wait)."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.event = None


def make_transfer_engine(device_pool: list[torch.Tensor], swap_bytes: int,
                         offload_bytes: int) -> tuple[BlockTransferEngine | None, int, int]:
    """The host pools (pinned on a GPU) of swap_bytes and offload_bytes and the engine between
    them and the device pool: (engine or None without host pools, swap blocks, offload blocks)."""
    block_bytes = sum(t[0].numel() * t.element_size() for t in device_pool)
    num_swap, num_offload = swap_bytes // block_bytes, offload_bytes // block_bytes
    pin = device_pool[0].device.type == "cuda"
    pools = {name: allocate_host_pool(device_pool, n, pin)
             for name, n in (("swap", num_swap), ("offload", num_offload)) if n > 0}
    return (BlockTransferEngine(device_pool, pools) if pools else None), num_swap, num_offload
