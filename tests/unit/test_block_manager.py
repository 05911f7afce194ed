"""Block manager: free queue, allocation, reference counts, prefix caching, LRU eviction.

Pure Python, no torch. The stateful test at the end keeps its own ground truth of what every
KV block holds (as a model runner would write it) and checks the manager's bookkeeping against
it after every operation.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minivllm.core.block_manager import BlockManager, FreeBlockQueue, KVBlock, hash_block
from minivllm.core.request import PromptGroup, Request
from minivllm.sampling_params import SamplingParams


def make_req(rid: str, tokens: list[int], max_tokens: int = 16, group: PromptGroup | None = None,
             sample_index: int = 0) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), frozenset(), 0.0, max_tokens,
                   sample_index=sample_index, group=group)


def admit_and_compute(bm: BlockManager, req: Request) -> list[KVBlock]:
    """What the scheduler + runner do for a fresh request that fits: take the cached prefix,
    allocate the rest, compute everything, register the full blocks. Returns the hits."""
    hits = bm.find_cached_prefix(req)
    assert bm.allocate(req, req.num_tokens - len(hits) * bm.block_size, hits) is not None
    req.num_computed_tokens = req.num_tokens
    bm.register_computed_blocks(req)
    return hits


def referenced(bm: BlockManager) -> set[int]:
    return {b.block_id for b in bm.blocks if b.ref_cnt > 0}


# ---- FreeBlockQueue ---------------------------------------------------------------------------

def test_free_queue_order_append_remove_popleft():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    assert q.num_free == 5
    q.remove(blocks[2])  # from the middle
    assert blocks[2] not in q and blocks[1] in q
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    q.remove(blocks[4])  # the last one
    q.remove(blocks[0])  # the first one
    assert [b.block_id for b in q] == [1, 3]
    q.append(blocks[2])
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 2, 0]
    assert q.num_free == 4
    assert [q.popleft().block_id for _ in range(4)] == [1, 3, 2, 0]
    assert q.num_free == 0 and list(q) == []
    with pytest.raises(RuntimeError):
        q.popleft()
    q.append(blocks[3])
    assert [b.block_id for b in q] == [3] and q.num_free == 1


def test_free_queue_rejects_double_append_and_removing_absent_block():
    blocks = [KVBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)
    with pytest.raises(AssertionError):
        q.append(blocks[1])  # already queued
    b = q.popleft()
    with pytest.raises(AssertionError):
        q.remove(b)  # not queued any more


class _CountingBlock(KVBlock):
    """KVBlock that counts reads and writes of its queue links."""

    touches = 0

    def __getattribute__(self, name):
        if name in ("prev", "next"):
            type(self).touches += 1
        return object.__getattribute__(self, name)

    def __setattr__(self, name, value):
        if name in ("prev", "next"):
            type(self).touches += 1
        object.__setattr__(self, name, value)


@pytest.mark.parametrize("op", ["remove_middle", "popleft", "append"])
def test_free_queue_ops_are_constant_time(op):
    """Each operation touches a fixed number of links, however long the queue is."""

    def cost(n: int) -> int:
        blocks = [_CountingBlock(i) for i in range(n)]
        q = FreeBlockQueue(blocks)
        extra = q.popleft()
        _CountingBlock.touches = 0
        if op == "remove_middle":
            q.remove(blocks[n // 2])
        elif op == "popleft":
            q.popleft()
        else:
            q.append(extra)
        return _CountingBlock.touches

    small, large = cost(8), cost(4000)
    assert small > 0
    assert large == small


# ---- allocation -------------------------------------------------------------------------------

def test_allocate_grows_table_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=False)
    req = make_req("a", list(range(10)))
    assert bm.allocate(req, 10) == [0, 1, 2]  # ceil(10 / 4) blocks, from the front of the free queue
    assert bm.num_free_blocks == 5 and referenced(bm) == {0, 1, 2}
    assert all(bm.blocks[i].ref_cnt == 1 for i in (0, 1, 2))
    req.num_computed_tokens = 10
    assert bm.allocate(req, 2) == []  # 12 tokens still fit in 3 blocks
    assert bm.allocate(req, 3) == [3]  # 13 tokens need a 4th
    assert bm.block_ids("a") == [0, 1, 2, 3]
    bm.free(req)
    assert bm.num_free_blocks == 8 and referenced(bm) == set()
    assert bm.block_ids("a") == []


def test_allocate_refuses_without_changing_state():
    bm = BlockManager(num_blocks=4, block_size=4, enable_caching=False)
    a, b = make_req("a", list(range(12))), make_req("b", list(range(8)))
    assert bm.allocate(a, 12) == [0, 1, 2]
    assert not bm.can_allocate(b, 8)
    assert bm.allocate(b, 8) is None
    assert bm.num_free_blocks == 1 and bm.block_ids("b") == [] and referenced(bm) == {0, 1, 2}
    assert bm.allocate(b, 4) == [3]


# ---- prefix caching ---------------------------------------------------------------------------

def test_prefix_hit_on_identical_prefix_shares_blocks():
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    prompt = list(range(100, 114))  # 3 full blocks + 2 tokens
    a = make_req("a", prompt)
    assert admit_and_compute(bm, a) == []
    a_ids = bm.block_ids("a")
    b = make_req("b", prompt)
    hits = bm.find_cached_prefix(b)
    assert [h.block_id for h in hits] == a_ids[:3]
    assert bm.prefix_hits == 12 and bm.prefix_queries == 2 * len(prompt)
    added = bm.allocate(b, len(prompt) - 12, hits)
    assert added[:3] == a_ids[:3] and added[3] not in a_ids
    assert [bm.blocks[i].ref_cnt for i in a_ids] == [2, 2, 2, 1]


def test_prefix_hit_after_owner_freed_takes_blocks_out_of_free_queue():
    bm = BlockManager(num_blocks=6, block_size=4, enable_caching=True)
    prompt = list(range(9))  # 2 full blocks + 1
    a = make_req("a", prompt)
    admit_and_compute(bm, a)
    a_ids = bm.block_ids("a")
    bm.free(a)
    assert bm.num_free_blocks == 6
    b = make_req("b", prompt + [50, 51, 52])
    hits = bm.find_cached_prefix(b)
    assert [h.block_id for h in hits] == a_ids[:2]
    assert bm.allocate(b, b.num_tokens - 8, hits) is not None
    assert bm.num_free_blocks == 6 - 3
    assert all(h not in bm.free_queue and h.ref_cnt == 1 for h in hits)


def test_prefix_cache_respects_capacity_of_hits_in_free_queue():
    """Hits sitting in the free queue use up free blocks too: can_allocate must count them."""
    bm = BlockManager(num_blocks=3, block_size=2, enable_caching=True)
    a = make_req("a", [1, 2, 3, 4, 5])  # 3 blocks
    admit_and_compute(bm, a)
    bm.free(a)
    b = make_req("b", [1, 2, 3, 4, 9, 9, 9])  # hits 2 blocks, needs 2 more: 4 > 3
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    assert bm.allocate(b, 3, hits) is None
    assert bm.num_free_blocks == 3 and referenced(bm) == set()


@pytest.mark.parametrize("diff_pos,expected_hits", [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2)])
def test_prefix_miss_when_one_token_differs_chained(diff_pos, expected_hits):
    """Block hashes chain: a difference in block k means no hit from block k on, even where later
    blocks hold identical tokens."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    prompt = list(range(200, 213))  # 3 full blocks + 1
    admit_and_compute(bm, make_req("a", prompt))
    other = list(prompt)
    other[diff_pos] = 999
    hits = bm.find_cached_prefix(make_req("b", other))
    assert len(hits) == expected_hits
    assert bm.prefix_hits == expected_hits * 4


def test_chained_hash_differs_from_unchained():
    assert hash_block(None, (1, 2)) != hash_block(hash_block(None, (0, 0)), (1, 2))


@pytest.mark.parametrize("length,expected_hits", [(4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3)])
def test_hit_never_covers_last_token(length, expected_hits):
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    tokens = list(range(300, 316))
    admit_and_compute(bm, make_req("a", tokens))  # 4 full blocks registered
    hits = bm.find_cached_prefix(make_req("b", tokens[:length]))
    assert len(hits) == expected_hits
    assert len(hits) * 4 <= length - 1


def test_no_cache_hits_when_caching_disabled():
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=False)
    prompt = list(range(13))
    admit_and_compute(bm, make_req("a", prompt))
    assert bm.cached == {}
    assert bm.find_cached_prefix(make_req("b", prompt)) == []
    assert bm.prefix_queries == 0 and bm.prefix_hits == 0


def test_siblings_share_even_with_caching_disabled_and_forget_when_freed():
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=False)
    group = PromptGroup(2)
    prompt = list(range(10))
    a = make_req("a#0", prompt, group=group)
    b = make_req("a#1", prompt, group=group, sample_index=1)
    admit_and_compute(bm, a)
    hits = admit_and_compute(bm, b)
    assert [h.block_id for h in hits] == bm.block_ids("a#0")[:2]
    assert [h.ref_cnt for h in hits] == [2, 2]
    bm.free(a)
    bm.free(b)
    assert bm.cached == {} and all(blk.block_hash is None for blk in bm.blocks)
    # an unrelated n=1 request never shares with caching disabled
    assert bm.find_cached_prefix(make_req("c", prompt)) == []


def test_lru_eviction_tail_first_and_earlier_freed_first():
    bs = 2
    bm = BlockManager(num_blocks=6, block_size=bs, enable_caching=True)
    a = make_req("a", [1, 2, 3, 4, 5, 6])
    b = make_req("b", [7, 8, 9, 10, 11, 12])
    admit_and_compute(bm, a)
    admit_and_compute(bm, b)
    a_ids, b_ids = bm.block_ids("a"), bm.block_ids("b")
    bm.free(a)  # freed first
    bm.free(b)
    expected_order = a_ids[::-1] + b_ids[::-1]
    assert [blk.block_id for blk in bm.free_queue] == expected_order
    # allocate one block at a time and watch which cached content disappears
    evicted = []
    for k in range(6):
        filler = make_req(f"f{k}", [100 + k])
        evicted += bm.allocate(filler, 1)
        assert bm.blocks[evicted[-1]].block_hash is None
    assert evicted == expected_order
    assert bm.cached == {}


def test_eviction_shrinks_hit_from_the_tail():
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1
    admit_and_compute(bm, a)
    bm.free(a)  # free queue: partial block, then blocks 2, 1, 0 of a
    probe = make_req("p", [1, 2, 3, 4, 5, 6, 7])
    assert len(bm.find_cached_prefix(probe)) == 3
    for k, hits_left in enumerate([3, 2, 1, 0]):
        bm.allocate(make_req(f"f{k}", [90]), 1)
        assert len(bm.find_cached_prefix(probe)) == hits_left


def test_hit_refreshes_lru_position():
    """A block reused through a hit and freed again becomes most recently used."""
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    a = make_req("a", [1, 2, 3])
    c = make_req("c", [5, 6, 7])
    admit_and_compute(bm, a)
    admit_and_compute(bm, c)
    a_head, c_head = bm.block_ids("a")[0], bm.block_ids("c")[0]
    bm.free(a)
    bm.free(c)  # LRU: a's blocks, then c's
    b = make_req("b", [1, 2, 9])
    assert [h.block_id for h in admit_and_compute(bm, b)] == [a_head]
    bm.free(b)  # a's head goes to the back of the queue again
    assert [blk.block_id for blk in bm.free_queue][-1] == a_head
    for k in range(3):  # evict everything else
        bm.allocate(make_req(f"f{k}", [90]), 1)
    assert bm.blocks[a_head].block_hash is not None and bm.blocks[c_head].block_hash is None
    assert len(bm.find_cached_prefix(make_req("p", [1, 2, 3]))) == 1
    assert bm.find_cached_prefix(make_req("q", [5, 6, 7])) == []


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    prompt = list(range(9))
    a = make_req("a", prompt)
    admit_and_compute(bm, a)
    assert bm.reset_prefix_cache() is False  # a block is in use
    assert len(bm.cached) == 2
    bm.free(a)
    assert len(bm.find_cached_prefix(make_req("b", prompt))) == 2
    assert bm.reset_prefix_cache() is True
    assert bm.cached == {} and all(blk.block_hash is None for blk in bm.blocks)
    assert bm.find_cached_prefix(make_req("c", prompt)) == []
    assert bm.num_free_blocks == 8


# ---- stateful: random operations with a ground truth of block contents -----------------------

class _Live:
    __slots__ = ("req", "pending")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.pending = 0  # tokens allocated but not computed yet (scheduled, runner not done)


class BlockManagerMachine(RuleBasedStateMachine):
    """Requests with tokens from a tiny vocabulary (so prefixes collide) go through the block
    manager as the scheduler drives it. `content[block_id]` is what the runner wrote into each
    slot of each block; a prefix hit must return blocks whose content equals the request's tokens."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 14), caching=st.booleans())
    def setup(self, block_size, num_blocks, caching):
        self.bs = block_size
        self.caching = caching
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.content: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tables: dict[str, list[int]] = {}  # the test's own copy of each block table
        self.live: dict[str, _Live] = {}
        self.next_id = 0

    # -- helpers --
    def _pick(self, idx: int) -> _Live:
        keys = sorted(self.live)
        return self.live[keys[idx % len(keys)]]

    def _admit(self, req: Request, chunk: int) -> None:
        """Waiting -> running: cached prefix + the first chunk, or stay out if it doesn't fit."""
        bm, bs = self.bm, self.bs
        q0, h0 = bm.prefix_queries, bm.prefix_hits
        hits = bm.find_cached_prefix(req)
        uses_cache = self.caching or (req.group is not None and req.group.size > 1)
        if not uses_cache:
            assert hits == []
        assert len(hits) * bs <= req.num_tokens - 1, "a hit must leave at least one token to compute"
        for i, blk in enumerate(hits):
            assert self.content[blk.block_id] == req.all_token_ids[i * bs:(i + 1) * bs], \
                f"hit block {blk.block_id} holds other tokens than block {i} of the request"
        if self.caching:
            assert bm.prefix_queries == q0 + req.num_tokens
            assert bm.prefix_hits == h0 + len(hits) * bs
        num_cached = len(hits) * bs
        n = 1 + (chunk % (req.num_tokens - num_cached))
        need = bm.blocks_needed(num_cached + n) - len(hits) + sum(1 for b in hits if b.ref_cnt == 0)
        free_before = bm.num_free_blocks
        added = bm.allocate(req, n, hits)
        if added is None:
            assert need > free_before
            assert req.request_id not in bm.req_blocks and bm.num_free_blocks == free_before
            return
        assert need <= free_before
        assert added[:len(hits)] == [b.block_id for b in hits]
        for bid in added[len(hits):]:
            self.content[bid] = [None] * bs  # a reused block's old content is about to be overwritten
        self.tables[req.request_id] = list(added)
        req.num_computed_tokens = num_cached
        live = _Live(req)
        live.pending = n
        self.live[req.request_id] = live

    # -- rules --
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=14), chunk=st.integers(0, 20),
          grouped=st.booleans())
    def add_request(self, tokens, chunk, grouped):
        group = PromptGroup(2) if grouped else None
        req = make_req(f"r{self.next_id}", tokens, max_tokens=64, group=group)
        self.next_id += 1
        self._admit(req, chunk)

    @precondition(lambda self: any(lv.pending for lv in self.live.values()))
    @rule(idx=st.integers(0, 50))
    def compute(self, idx):
        """The runner computes a scheduled chunk; the scheduler then registers full blocks."""
        pending = sorted(rid for rid, lv in self.live.items() if lv.pending)
        lv = self.live[pending[idx % len(pending)]]
        req, bs = lv.req, self.bs
        table = self.tables[req.request_id]
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + lv.pending):
            blk = self.bm.blocks[table[pos // bs]]
            # never write into a block someone else uses or that the prefix cache serves
            assert blk.ref_cnt == 1 and blk.block_hash is None, f"write into shared/cached block {blk}"
            self.content[blk.block_id][pos % bs] = req.all_token_ids[pos]
        req.num_computed_tokens += lv.pending
        lv.pending = 0
        self.bm.register_computed_blocks(req)

    @precondition(lambda self: any(not lv.pending and lv.req.num_computed_tokens < lv.req.num_tokens
                                   for lv in self.live.values()))
    @rule(idx=st.integers(0, 50), chunk=st.integers(0, 20))
    def schedule_chunk(self, idx, chunk):
        ready = sorted(rid for rid, lv in self.live.items()
                       if not lv.pending and lv.req.num_computed_tokens < lv.req.num_tokens)
        lv = self.live[ready[idx % len(ready)]]
        req = lv.req
        n = 1 + chunk % (req.num_tokens - req.num_computed_tokens)
        table = self.tables[req.request_id]
        pos = req.num_computed_tokens
        # a forked sequence about to write into a shared, partly filled block needs a copy of it
        cow_needed = pos % self.bs != 0 and self.bm.blocks[table[pos // self.bs]].ref_cnt > 1
        added = self.bm.allocate(req, n)
        if added is None:
            assert self.bm.blocks_needed(pos + n) - len(table) + cow_needed > self.bm.num_free_blocks
            assert req.request_id not in self.bm.cow
            return
        cow = self.bm.cow.pop(req.request_id, None)
        assert (cow is not None) == cow_needed
        if cow is not None:  # what the runner does: copy the block's K/V, then use the copy
            index, src, dst = cow
            assert table[index] == src and index == pos // self.bs and self.bm.blocks[dst].ref_cnt == 1
            self.content[dst] = list(self.content[src])
            table[index] = dst
        for bid in added:
            self.content[bid] = [None] * self.bs
        table += added
        lv.pending = n

    @precondition(lambda self: any(not lv.pending for lv in self.live.values()))
    @rule(idx=st.integers(0, 50))
    def fork(self, idx):
        """Beam search: a new sequence with the parent's tokens shares its whole block table."""
        ready = sorted(rid for rid, lv in self.live.items() if not lv.pending)
        parent = self.live[ready[idx % len(ready)]].req
        child = make_req(f"r{self.next_id}", parent.prompt_token_ids, max_tokens=64)
        self.next_id += 1
        for t in parent.output_token_ids:
            child.append_output_token(t)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        before = [self.bm.blocks[b].ref_cnt for b in self.tables[parent.request_id]]
        self.bm.fork(parent, child)
        assert [self.bm.blocks[b].ref_cnt for b in self.tables[parent.request_id]] == [c + 1 for c in before]
        self.tables[child.request_id] = list(self.tables[parent.request_id])
        self.live[child.request_id] = _Live(child)

    @precondition(lambda self: any(not lv.pending and lv.req.num_computed_tokens == lv.req.num_tokens
                                   for lv in self.live.values()))
    @rule(idx=st.integers(0, 50), token=st.integers(0, 1))
    def decode(self, idx, token):
        """The step sampled a token: the request has one more token to compute."""
        done = sorted(rid for rid, lv in self.live.items()
                      if not lv.pending and lv.req.num_computed_tokens == lv.req.num_tokens)
        self.live[done[idx % len(done)]].req.append_output_token(token)

    @precondition(lambda self: self.live)
    @rule(idx=st.integers(0, 50))
    def free(self, idx):
        lv = self._pick(idx)
        rid = lv.req.request_id
        table = [self.bm.blocks[b] for b in self.tables.pop(rid)]
        released = [b.block_id for b in reversed(table) if b.ref_cnt == 1]
        self.bm.free(lv.req)
        del self.live[rid]
        # LRU: the released blocks are now the most recently freed, tail first
        queue = [b.block_id for b in self.bm.free_queue]
        assert queue[len(queue) - len(released):] == released

    @precondition(lambda self: self.live)
    @rule(idx=st.integers(0, 50), chunk=st.integers(0, 20))
    def preempt_and_resume(self, idx, chunk):
        """Free for recompute, then admit the same request object again (its hashes are kept)."""
        lv = self._pick(idx)
        req = lv.req
        self.bm.free(req)
        del self.tables[req.request_id], self.live[req.request_id]
        req.num_computed_tokens = 0
        self._admit(req, chunk)

    @rule()
    def reset_prefix_cache(self):
        in_use = self.bm.num_free_blocks != self.bm.num_blocks
        before = dict(self.bm.cached)
        ok = self.bm.reset_prefix_cache()
        assert ok is (not in_use)
        if ok:
            assert self.bm.cached == {}
        else:
            assert self.bm.cached == before

    # -- invariants, checked after every step --
    @invariant()
    def block_accounting(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        queue = list(bm.free_queue)
        queued = [b.block_id for b in queue]
        assert len(queued) == len(set(queued)) == bm.num_free_blocks
        queued_set = set(queued)
        holders: dict[int, int] = {}
        for rid, table in self.tables.items():
            assert bm.block_ids(rid) == table
            assert len(table) == len(set(table)), "a block twice in one table"
            for bid in table:
                holders[bid] = holders.get(bid, 0) + 1
        assert set(bm.req_blocks) == set(self.tables)
        num_referenced = 0
        for blk in bm.blocks:
            in_queue = blk.block_id in queued_set
            assert (blk.ref_cnt > 0) != in_queue, f"block {blk.block_id}: ref_cnt={blk.ref_cnt}, queued={in_queue}"
            assert blk.ref_cnt == holders.get(blk.block_id, 0)
            num_referenced += blk.ref_cnt > 0
            if blk.block_hash is not None:
                assert bm.cached.get(blk.block_hash) is blk
                assert None not in self.content[blk.block_id], "a registered block must be fully computed"
                if not self.caching:
                    assert blk.ref_cnt > 0, "with caching off, a hash must not outlive its users"
        assert bm.num_free_blocks + num_referenced == bm.num_blocks
        for h, blk in bm.cached.items():
            assert blk.block_hash == h
        for lv in self.live.values():
            req = lv.req
            assert len(self.tables[req.request_id]) == bm.blocks_needed(req.num_computed_tokens + lv.pending)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for lv in list(self.live.values()):
            self.bm.free(lv.req)
        assert all(b.ref_cnt == 0 for b in self.bm.blocks), "leaked block references"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.req_blocks == {}


BlockManagerMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestBlockManagerStateful = BlockManagerMachine.TestCase
