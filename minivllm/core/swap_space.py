"""Swap preemption's bookkeeping (pure Python): which host blocks hold a preempted request's KV.

A request preempted by swapping keeps its computed tokens: the blocks that hold them are copied
to a pool of host blocks (the runner makes the copies, kv_transfer/block_transfer.py) and its
device blocks are freed; when it resumes, fresh device blocks are allocated and the host blocks
copied back. `SwapSpace.should_swap` is the per-request choice:

- preemption_mode "recompute": never swap; "swap": always, while the host pool has room;
- unset (None): swap when recomputing the tokens would take longer than copying their blocks
  out and back in (a cost model from the engine, kv_transfer/cost.py), else recompute;
  recompute whenever the host pool is full.
"""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("swap", "recompute")


class HostBlockPool:
    """Free list of host block ids 0 .. num_blocks - 1 (LIFO: a block just freed is reused first)."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 0
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))
        assert len(self._free) <= self.num_blocks, "a host block was freed twice"


@dataclass(frozen=True)
class SwapCosts:
    """Seconds to recompute one token (prefill) and to copy one block one way (device <-> host)."""

    recompute_s_per_token: float
    copy_s_per_block: float


class SwapSpace:
    def __init__(self, num_blocks: int, mode: str | None, costs: SwapCosts | None) -> None:
        assert mode is None or mode in PREEMPTION_MODES, mode
        self.pool = HostBlockPool(num_blocks)
        self.mode = mode
        self.costs = costs
        self.swapped: dict[str, list[int]] = {}  # request id -> host blocks holding its first tokens
        self.num_blocks_swapped_out = 0  # totals (metrics)
        self.num_blocks_swapped_in = 0

    def should_swap(self, num_tokens: int, num_blocks: int) -> bool:
        """Whether a request whose first num_tokens tokens sit in num_blocks blocks is swapped."""
        if self.mode == "recompute" or num_blocks == 0 or num_blocks > self.pool.num_free:
            return False
        if self.mode == "swap" or self.costs is None:
            return True
        c = self.costs
        return num_tokens * c.recompute_s_per_token > 2 * num_blocks * c.copy_s_per_block

    def swap_out(self, req_id: str, device_blocks: list[int]) -> list[tuple[int, int]]:
        """Host blocks for the request's device blocks (should_swap said yes): (device, host) pairs."""
        assert req_id not in self.swapped
        host = self.pool.allocate(len(device_blocks))
        assert host is not None
        self.swapped[req_id] = host
        self.num_blocks_swapped_out += len(host)
        return list(zip(device_blocks, host))

    def swap_in(self, req_id: str, device_blocks: list[int]) -> list[tuple[int, int]]:
        """The request resumes in these device blocks: (host, device) pairs; its host blocks are free
        for later steps (the copies of one step are made in order, kv_transfer/block_transfer.py)."""
        host = self.swapped.pop(req_id)
        assert len(device_blocks) >= len(host)
        self.pool.free(host)
        self.num_blocks_swapped_in += len(host)
        return list(zip(host, device_blocks))

    def discard(self, req_id: str) -> bool:
        """Forget a request's swapped blocks (it finished, or its copy is not to be trusted)."""
        host = self.swapped.pop(req_id, None)
        if host is not None:
            self.pool.free(host)
        return host is not None
