"""KV blocks on the move: the block copy engine between the device KV pool and host pools
(block_transfer.py), the host pools of swap preemption and of the prefix cache's offload tier,
and the swap-or-recompute cost model (cost.py). The bookkeeping is pure Python in core/
(swap_space.py, offload_cache.py); this package holds the tensors."""
