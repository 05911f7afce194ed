"""Per-step statistics: a ring buffer the engine fills at every step (the dashboard, the timelines
of the benchmarks and /load read it).

Cost: one small record per step (counts the scheduler and block manager already keep, plus one
pass over the step's scheduled requests for the prefill/decode split); the KV block map, which
walks every used block, is taken at most every `block_map_interval_s` and only when asked for
(the server's dashboard asks; offline runs never do).

    engine.step() -> StepHistory.record(sched, engine)   (engine thread / engine-core process)
                  -> ring of StepRecord (maxlen), last_batch, block_map (every interval)
    reader        -> history.since(step) / snapshot()    (any thread: a lock guards the ring)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields

DEFAULT_CAPACITY = 4096  # steps kept (a dashboard shows the last minutes; a timeline sets more)
MAX_BATCH_ENTRIES = 256  # requests of the latest step shown in the batch composition
MAX_MAP_CELLS = 1024  # cells of the KV block map (each cell stands for one or more blocks)

# KV block map cell codes: 0 free, 1 free but holding a cached prefix block, k >= 2 used by the
# request with legend index k - 2
FREE, CACHED = 0, 1


@dataclass(slots=True)
class StepRecord:
    """One engine step. Counters named *_total are cumulative since the engine started."""

    step: int
    t: float  # wall time (time.time()) when the step was scheduled
    num_seqs: int  # requests in the step
    num_tokens: int  # tokens scheduled (prefill + decode + drafts)
    prefill_tokens: int  # prompt tokens and recomputed tokens
    decode_tokens: int  # one per decoding request, plus its draft tokens
    token_budget: int  # max_num_batched_tokens
    num_running: int
    num_waiting: int
    kv_used_blocks: int
    kv_cached_blocks: int  # blocks holding a prefix-cache hash (in use or free)
    num_blocks: int
    preemptions_total: int
    prefix_queries_total: int  # tokens looked up in the prefix cache
    prefix_hits_total: int  # tokens found
    spec_draft_tokens_total: int
    spec_accepted_tokens_total: int
    generation_tokens_total: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class BlockMap:
    """The KV cache at one instant, at most MAX_MAP_CELLS cells of `blocks_per_cell` blocks;
    a cell shows its first block's state (codes above)."""

    t: float
    num_blocks: int
    blocks_per_cell: int
    cells: list[int]
    legend: list[str]  # request ids, by code - 2

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class HistorySnapshot:
    """What a reader gets: records newer than asked, the latest batch and block map."""

    records: list[StepRecord]
    last_batch: list[tuple[str, int, int]]  # (request id, prefill tokens, decode tokens)
    block_map: BlockMap | None = None
    extra: dict = field(default_factory=dict)


class StepHistory:
    """The ring buffer of StepRecords, the latest batch's composition and the latest KV block map.

    Written by one thread (the engine's, or for a mirror the client's receiver); read by any
    under a lock. An engine-side history records steps; a mirror (the HTTP process of an
    engine-core process) is filled with `add` from what the engine core sends."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, block_map_interval_s: float | None = None) -> None:
        self._ring: deque[StepRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        # the latest step's ScheduledRequests (engine side; not changed after scheduling) or, in
        # a mirror, its composition as sent
        self._last_batch: list = []
        self._block_map: BlockMap | None = None
        self.block_map_interval_s = block_map_interval_s  # None: never take one
        self._next_map_t = 0.0
        self._next_step = 0

    @property
    def capacity(self) -> int:
        return self._ring.maxlen or 0

    def set_capacity(self, capacity: int) -> None:
        """Keep up to `capacity` steps (a benchmark's timeline keeps the whole run)."""
        if capacity < 1:
            raise ValueError(f"step history capacity must be >= 1, got {capacity}")
        with self._lock:
            self._ring = deque(self._ring, maxlen=capacity)

    def clear(self) -> None:
        with self._lock:
            self._ring.clear()

    # ---- engine side --------------------------------------------------------------------------
    def record(self, sched, scheduler, block_manager, generation_tokens_total: int) -> None:
        """One step, just scheduled (sched: SchedulerOutput)."""
        decode = 0
        for s in sched.scheduled:  # the one pass over the batch (the composition is built when read)
            n = len(s.token_ids)
            if s.samples and n - s.num_draft_tokens == 1:  # one known token, and it samples: decoding
                decode += n
        now = time.time()
        rec = state_record(self._next_step, now, scheduler, block_manager, generation_tokens_total)
        rec.num_seqs, rec.num_tokens = len(sched.scheduled), sched.num_scheduled_tokens
        rec.prefill_tokens, rec.decode_tokens = sched.num_scheduled_tokens - decode, decode
        block_map = take_block_map(block_manager, now) if self.block_map_due(now) else None
        self.add([rec], sched.scheduled, block_map)

    def block_map_due(self, now: float) -> bool:
        """Whether a KV block map should be taken now (at most every block_map_interval_s, and
        only while someone asked for them); when it is, the next one is due an interval later."""
        if self.block_map_interval_s is None or now < self._next_map_t:
            return False
        self._next_map_t = now + self.block_map_interval_s
        return True

    def latest_batch(self) -> list:
        """The latest step's batch as recorded (ScheduledRequests, or tuples in a mirror): not
        copied, for a merged history (data parallelism) that joins several replicas' batches."""
        with self._lock:
            return self._last_batch

    # ---- both sides ---------------------------------------------------------------------------
    def add(self, records: list[StepRecord], last_batch: list[tuple[str, int, int]] | None,
            block_map: BlockMap | None) -> None:
        with self._lock:
            self._ring.extend(records)
            if records:
                self._next_step = records[-1].step + 1
            if last_batch is not None:
                self._last_batch = last_batch
            if block_map is not None:
                self._block_map = block_map

    def since(self, step: int = 0, limit: int | None = None) -> HistorySnapshot:
        """Records with record.step >= step (the newest `limit` of them), the latest batch and map."""
        with self._lock:
            skip = max(0, len(self._ring) - (self._next_step - step))
            records = list(self._ring)[skip:]
            batch, block_map = self._last_batch, self._block_map
        if limit is not None:
            records = records[-limit:]
        return HistorySnapshot(records, batch_composition(batch), block_map)

    def latest(self) -> StepRecord | None:
        with self._lock:
            return self._ring[-1] if self._ring else None

    @property
    def next_step(self) -> int:
        return self._next_step


def state_record(step: int, t: float, scheduler, block_manager, generation_tokens_total: int) -> StepRecord:
    """A record of the engine's state (queue, KV, cumulative counters) with no tokens scheduled:
    the caller fills the step's own fields (num_seqs, num_tokens, prefill/decode tokens)."""
    bm, spec = block_manager, scheduler.spec_stats
    return StepRecord(step, t, 0, 0, 0, 0, scheduler.limits.max_num_batched_tokens, scheduler.num_running,
                      scheduler.num_waiting, bm.num_blocks - bm.num_free_blocks, len(bm.cached), bm.num_blocks,
                      scheduler.num_preemptions, bm.prefix_queries, bm.prefix_hits, spec.num_draft_tokens,
                      spec.num_accepted_tokens, generation_tokens_total)


_SUMMED_FIELDS = tuple(f.name for f in fields(StepRecord) if f.name not in ("step", "t"))


def merge_records(step: int, t: float, records: list[StepRecord]) -> StepRecord:
    """One record for several engines' steps taken together (data parallelism): every count is
    the sum (the token budget too: the replicas' combined capacity per step)."""
    merged = StepRecord(step, t, *([0] * len(_SUMMED_FIELDS)))
    for r in records:
        for f in _SUMMED_FIELDS:
            setattr(merged, f, getattr(merged, f) + getattr(r, f))
    return merged


def merge_block_maps(maps: list[BlockMap], now: float) -> BlockMap:
    """Several engines' block maps side by side (replica 0's cells first); the request codes of
    each later map are shifted past the earlier legends, so every request keeps its own colour."""
    cells: list[int] = []
    legend: list[str] = []
    for m in maps:
        shift = len(legend)
        cells += [c + shift if c >= 2 else c for c in m.cells]
        legend += m.legend
    return BlockMap(now, sum(m.num_blocks for m in maps), maps[0].blocks_per_cell, cells, legend)


def batch_composition(scheduled: list) -> list[tuple[str, int, int]]:
    """[(request id, prefill tokens, decode tokens)] of a step's first MAX_BATCH_ENTRIES
    requests; a composition already built passes through."""
    out = []
    for s in scheduled[:MAX_BATCH_ENTRIES]:
        if isinstance(s, tuple):
            out.append(s)
            continue
        n = len(s.token_ids)
        is_decode = s.samples and n - s.num_draft_tokens == 1
        out.append((s.req_id, 0 if is_decode else n, n if is_decode else 0))
    return out


def take_block_map(block_manager, now: float, max_cells: int = MAX_MAP_CELLS) -> BlockMap:
    """Walks the used and cached blocks once (not every free one): O(used blocks)."""
    bm = block_manager
    per = -(-bm.num_blocks // max_cells)
    cells = [FREE] * -(-bm.num_blocks // per)
    for b in bm.cached.values():
        if b.block_id % per == 0:
            cells[b.block_id // per] = CACHED
    legend: list[str] = []
    for rid, blocks in bm.req_blocks.items():
        code = len(legend) + 2
        legend.append(rid)
        for b in blocks:
            if b.block_id % per == 0:
                cells[b.block_id // per] = code
    return BlockMap(now, bm.num_blocks, per, cells, legend)
