"""Paged KV cache bookkeeping: free-block queue, reference counts, prefix caching.

A request owns a block table (list of block ids). Token i of a request lives in slot
block_table[i // block_size] * block_size + i % block_size.

Prefix caching: every *full* block gets a hash chained with its parent's (a digest of the
parent's hash, the block's token ids and, in the first block, the request's cache salt:
core/block_hash.py), registered once its tokens are computed.
A freed block keeps its hash and stays findable until it is reused: the free queue is LRU by
release time, and a request releases its tail blocks first so they are evicted first.

Beam search forks a sequence by copying its block table (every block's ref_cnt + 1), so beams
share the prompt's and their common prefix's blocks. A shared block is never written in place:
full blocks are never written again, and before a sequence writes into a shared, partly filled
last block, `allocate` gives it a copy (copy-on-write): a fresh block in its table at that index,
recorded in `cow` for the runner, which copies the source's K/V before the step's forward pass.

    parent  [b0 b1 b2*]        b2* partly filled         fork -> child [b0 b1 b2*]  (ref 2 each)
    child writes its next token: b2* is shared -> child [b0 b1 b5], copy b2* -> b5 first

With an offload tier (core/offload_cache.py) an evicted block's content is copied to host memory
first, and a prefix that continues there is loaded back into free blocks.

Invariant (tested): every block is either referenced (ref_cnt > 0) or in the free queue, never both.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.core.block_hash import BlockHash, block_hash_fn, extra_key, sha256_block
from minivllm.core.offload_cache import OffloadCache
from minivllm.core.request import Request


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block holds a registered full block
    prev: KVBlock | None = None  # free-queue links (None when not queued)
    next: KVBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the front, append, removal from the middle."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None and block.prev is None and block.next is None
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, "block is not in the free queue"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next
        if first is self._tail or first is None:
            raise RuntimeError("no free KV blocks")
        self.remove(first)
        return first

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev is not None

    def __iter__(self):
        b = self._head.next
        while b is not None and b is not self._tail:
            yield b
            b = b.next


def hash_block(parent_hash: BlockHash | None, token_ids: tuple[int, ...], extra: bytes = b"") -> BlockHash:
    """The default (sha256) block hash; see core/block_hash.py."""
    return sha256_block(parent_hash, token_ids, extra)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, hash_algo: str = "sha256",
                 offload: OffloadCache | None = None) -> None:
        assert num_blocks > 0 and block_size > 0
        assert offload is None or enable_caching, "the offload tier extends the prefix cache"
        self.offload = offload
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._hash = block_hash_fn(hash_algo)
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}  # block hash -> block holding it
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_registered: dict[str, int] = {}  # full blocks of a request registered so far
        # copy-on-write done by allocate and not yet sent to the runner: req id -> (table index,
        # source block id, new block id); the scheduler takes it into the step's ScheduledRequest
        self.cow: dict[str, tuple[int, int, int]] = {}
        # prefix-cache statistics in tokens (vLLM's prefix_cache_queries / prefix_cache_hits)
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix caching -------------------------------------------------------------------
    def _uses_cache(self, req: Request) -> bool:
        # siblings of an n>1 prompt and beams always share through the table, even with caching off
        return self.enable_caching or (req.group is not None and req.group.size > 1) or req.beam is not None

    def update_block_hashes(self, req: Request) -> None:
        """Extend req.block_hashes to cover every full block of req.all_token_ids."""
        bs = self.block_size
        hashes = req.block_hashes
        while (len(hashes) + 1) * bs <= req.num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            # the request's extra keys (its cache salt) go into the first block; the chain carries them
            extra = extra_key(req.cache_salt, req.lora_int_id) if i == 0 else b""
            hashes.append(self._hash(parent, req.all_token_ids[i * bs:(i + 1) * bs], extra))

    def cached_prefix_blocks(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """How many leading full blocks of this prompt are resident now (a data-parallel router's
        question: no request, no statistics, nothing changes)."""
        if not self.enable_caching:
            return 0
        bs, parent, n = self.block_size, None, 0
        for i in range((len(token_ids) - 1) // bs):
            parent = self._hash(parent, token_ids[i * bs:(i + 1) * bs], extra_key(cache_salt) if i == 0 else b"")
            if parent not in self.cached:
                break
            n += 1
        return n

    def find_cached_prefix(self, req: Request) -> list[KVBlock]:
        """Longest run of the request's leading full blocks found in the cache. At least one
        token is always left to compute, so the last token's logits can be sampled."""
        if not self._uses_cache(req):
            return []
        self.update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        limit = req.max_cached_prefix  # prompt logprobs / mean pooling compute what they still need
        if limit is not None:
            max_blocks = min(max_blocks, limit // self.block_size)
        hits: list[KVBlock] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        if self.offload is not None and len(hits) < max_blocks:
            hits += self._load_offloaded(req.block_hashes[len(hits):max_blocks], hits)
        if self.enable_caching:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += len(hits) * self.block_size
        return hits

    def _load_offloaded(self, hashes: list[BlockHash], hits: list[KVBlock]) -> list[KVBlock]:
        """The prefix's next blocks found in the offload tier (or, past the first, on the device
        again), the host ones loaded into free blocks (the copies go into this step's
        SchedulerOutput). Loaded blocks join the cache as free, findable blocks, so a request that
        then does not fit still finds them next step. The blocks found are held meanwhile, so that
        taking free blocks never evicts them."""
        found: list[KVBlock] = []
        if not hashes or hashes[0] not in self.offload:
            return found
        for block in hits:
            self._touch(block)
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                # one free block always stays, for at least one token of the request itself
                if h not in self.offload or self.num_free_blocks <= 1:
                    break
                block = self._pop_free()
                self.offload.load(h, block.block_id)
                block.block_hash = h
                self.cached[h] = block
                block.ref_cnt = 1
            else:
                self._touch(block)
            found.append(block)
        for block in hits + found:  # back to the free queue's tail if unused: evicted last
            self._release_block(block)
        return found

    # ---- allocation -----------------------------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, cached: list[KVBlock] = ()) -> bool:
        have = len(self.req_blocks.get(req.request_id, ())) + len(cached)
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - have + (self._cow_index(req) is not None)
        # cached blocks that sit in the free queue are taken out of it too
        reused_free = sum(1 for b in cached if b.ref_cnt == 0)
        return need + reused_free <= self.num_free_blocks

    def _cow_index(self, req: Request) -> int | None:
        """Table index of the block the request writes next if that block is shared and partly
        filled (it must be copied first); None otherwise."""
        pos = req.num_computed_tokens
        if pos % self.block_size == 0:
            return None  # the next write starts a new block
        table = self.req_blocks.get(req.request_id)
        i = pos // self.block_size
        if table is None or i >= len(table) or table[i].ref_cnt <= 1:
            return None
        return i

    def allocate(self, req: Request, num_new_tokens: int, cached: list[KVBlock] = ()) -> list[int] | None:
        """Give the request blocks for `num_new_tokens` more tokens (after taking `cached`
        prefix blocks). Returns the ids of the blocks added to its table, or None if they don't fit.
        A shared, partly filled block about to be written is replaced by a copy (see `cow`)."""
        if not cached:  # fast path, most decode steps: the last block still has room
            table = self.req_blocks.get(req.request_id)
            if table is not None and len(table) * self.block_size >= req.num_computed_tokens + num_new_tokens \
                    and self._cow_index(req) is None:
                return []
        if not self.can_allocate(req, num_new_tokens, cached):
            return None
        self._copy_on_write(req)
        table = self.req_blocks.setdefault(req.request_id, [])
        added: list[int] = []
        for block in cached:
            self._touch(block)
            table.append(block)
            added.append(block.block_id)
        if cached:
            self.num_registered[req.request_id] = len(table)
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        for _ in range(self.blocks_needed(total) - len(table)):
            block = self._pop_free()
            block.ref_cnt = 1
            table.append(block)
            added.append(block.block_id)
        return added

    def _copy_on_write(self, req: Request) -> None:
        i = self._cow_index(req)
        if i is None:
            return
        table = self.req_blocks[req.request_id]
        old, new = table[i], self._pop_free()
        new.ref_cnt = 1
        old.ref_cnt -= 1  # still >= 1: the other sharers keep it
        table[i] = new
        self.cow[req.request_id] = (i, old.block_id, new.block_id)

    def fork(self, parent: Request, child: Request) -> None:
        """Beam search: the child's table is a copy of the parent's, every block shared (ref_cnt + 1).
        The child must have the parent's tokens and num_computed_tokens."""
        table = self.req_blocks.get(parent.request_id, [])
        for block in table:
            block.ref_cnt += 1
        self.req_blocks[child.request_id] = list(table)
        self.num_registered[child.request_id] = self.num_registered.get(parent.request_id, 0)

    def _touch(self, block: KVBlock) -> None:
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def _pop_free(self) -> KVBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:  # evict: the cached content is about to be overwritten
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.offload is not None:  # ... copied to host memory first
                    self.offload.store(block.block_hash, block.block_id)
            block.block_hash = None
        return block

    def register_computed_blocks(self, req: Request) -> None:
        """Make the request's full, computed blocks findable by later requests."""
        # cheap exit first (called for every scheduled request, twice per step): no new full block
        if min(req.num_computed_tokens, len(req.all_token_ids)) // self.block_size <= \
                self.num_registered.get(req.request_id, 0):
            return
        if not self._uses_cache(req):
            return
        table = self.req_blocks.get(req.request_id)
        if not table:
            return
        # full blocks that are computed (or being computed by a step in flight, which runs before
        # any step that could hit them) and whose tokens are all known (no pending token)
        num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        num_full = min(num_full, len(table))
        start = self.num_registered.get(req.request_id, 0)
        if num_full <= start:
            return
        self.update_block_hashes(req)
        for i in range(start, num_full):
            block, h = table[i], req.block_hashes[i]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                self.cached[h] = block
        self.num_registered[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first (so the tail is evicted first)."""
        table = self.req_blocks.pop(req.request_id, [])
        self.num_registered.pop(req.request_id, None)
        self.cow.pop(req.request_id, None)
        for block in reversed(table):
            self._release_block(block)

    def _release_block(self, block: KVBlock) -> None:
        block.ref_cnt -= 1
        assert block.ref_cnt >= 0
        if block.ref_cnt == 0:
            if not self.enable_caching and block.block_hash is not None:
                # sharing among siblings only: forget the content once nobody uses it
                self.cached.pop(block.block_hash, None)
                block.block_hash = None
            self.free_queue.append(block)

    def forget_unwritten(self, req: Request, from_token: int) -> None:
        """A step that was to write the request's K/V from token `from_token` on failed: its
        blocks from the one holding that token are not what their hashes say (the hashes were
        published when the step was scheduled). Make them unfindable before they are freed."""
        first = from_token // self.block_size
        for block in self.req_blocks.get(req.request_id, [])[first:]:
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
        if req.request_id in self.num_registered:
            self.num_registered[req.request_id] = min(self.num_registered[req.request_id], first)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.offload is not None:
            self.offload.clear()
        return True

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, [])]
