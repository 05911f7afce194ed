"""The CPU offload tier of the prefix cache (pure Python bookkeeping).

Blocks evicted from the device prefix cache are copied to a pool of host blocks and stay
findable there by the same block hash (core/block_hash.py), least recently used first out. A
request whose prefix continues in host memory gets those blocks loaded back into fresh device
blocks (BlockManager.find_cached_prefix) instead of recomputing them.

The copies of a step are made by the runner before its forward, device-to-host ones first: a
device block evicted (stored) and refilled (loaded) in one step is copied out before it is
overwritten. The opposite case, a host block loaded from and overwritten by a store in one step,
is prevented here: a block loaded this step is pinned until the step's copies are taken.
"""

from __future__ import annotations

from collections import OrderedDict

from minivllm.core.block_hash import BlockHash
from minivllm.core.swap_space import HostBlockPool


class OffloadCache:
    def __init__(self, num_blocks: int) -> None:
        self.pool = HostBlockPool(num_blocks)
        self.blocks: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> host block, LRU first
        self._pinned: set[int] = set()  # host blocks this step loads from
        self.stores: list[tuple[int, int]] = []  # (device, host) copies of the step being scheduled
        self.loads: list[tuple[int, int]] = []  # (host, device)
        self.num_stored_blocks = 0  # totals (metrics)
        self.num_loaded_blocks = 0

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.blocks

    def store(self, block_hash: BlockHash, device_block: int) -> None:
        """A device block holding block_hash is about to be overwritten: keep a host copy."""
        if block_hash in self.blocks:  # already there (it was loaded from here): just refresh it
            self.blocks.move_to_end(block_hash)
            return
        host = self._take_block()
        if host is None:
            return  # every host block is pinned by this step's loads: the content is dropped
        self.blocks[block_hash] = host
        self.stores.append((device_block, host))
        self.num_stored_blocks += 1

    def _take_block(self) -> int | None:
        got = self.pool.allocate(1)
        if got is not None:
            return got[0]
        for h, host in self.blocks.items():  # the least recently used block no load of this step reads
            if host not in self._pinned:
                del self.blocks[h]
                return host
        return None

    def load(self, block_hash: BlockHash, device_block: int) -> None:
        """Copy the host block of block_hash into device_block (before this step's forward)."""
        host = self.blocks[block_hash]
        self.blocks.move_to_end(block_hash)
        self._pinned.add(host)
        self.loads.append((host, device_block))
        self.num_loaded_blocks += 1

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (stores, loads); the scheduler puts them into its SchedulerOutput."""
        stores, loads = self.stores, self.loads
        self.stores, self.loads, self._pinned = [], [], set()
        return stores, loads

    def clear(self) -> None:
        self.pool.free(list(self.blocks.values()))
        self.blocks.clear()
