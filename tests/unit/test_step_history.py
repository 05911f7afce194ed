"""StepHistory: the per-step ring buffer the engine fills (prefill/decode split, queue, KV use,
block map), driven by the real scheduler with hand-made runner outputs (no torch)."""

from __future__ import annotations

import pytest

from minivllm.core.interfaces import RunnerOutput
from minivllm.engine.step_history import CACHED, FREE, StepHistory, take_block_map
from tests.unit.test_scheduler import make_req, make_sched


def _step(sched, history: StepHistory):
    out = sched.schedule()
    history.record(out, sched, sched.block_manager, 0)
    sampled = [s.req_id for s in out.scheduled if s.samples]
    sched.update(out, RunnerOutput(sampled, [[7] for _ in sampled]))
    return out


def test_records_prefill_then_decode_split_and_queue():
    sched = make_sched(num_blocks=64, block_size=4, max_num_seqs=2, budget=16)
    for i in range(3):
        sched.add_request(make_req(f"r{i}", list(range(10 + i)), max_tokens=4))
    h = StepHistory(capacity=100)
    _step(sched, h)
    first = h.latest()
    # r0 (10 tokens) and 6 tokens of r1's prompt; r2 waits: max_num_seqs 2
    assert (first.step, first.num_seqs, first.num_tokens) == (0, 2, 16)
    assert (first.prefill_tokens, first.decode_tokens) == (16, 0)
    assert (first.num_running, first.num_waiting, first.token_budget) == (2, 1, 16)
    assert first.kv_used_blocks == 3 + 2 and first.num_blocks == 64
    assert h.since(0).last_batch == [("r0", 10, 0), ("r1", 6, 0)]
    _step(sched, h)  # r0 decodes one token, r1 finishes its prompt (5 tokens)
    second = h.latest()
    assert (second.step, second.prefill_tokens, second.decode_tokens) == (1, 5, 1)
    assert h.since(0).last_batch == [("r0", 0, 1), ("r1", 5, 0)]
    assert [r.step for r in h.since(1).records] == [1]
    assert [r.step for r in h.since(0).records] == [0, 1]


def test_ring_keeps_the_newest_and_since_counts_from_the_engine_step():
    h = StepHistory(capacity=3)
    sched = make_sched()
    sched.add_request(make_req("a", [1, 2, 3], max_tokens=10))
    for _ in range(5):
        _step(sched, h)
    assert [r.step for r in h.since(0).records] == [2, 3, 4]
    assert [r.step for r in h.since(4).records] == [4]
    assert h.since(5).records == []
    assert [r.step for r in h.since(0, limit=2).records] == [3, 4]
    h.set_capacity(10)
    assert [r.step for r in h.since(0).records] == [2, 3, 4] and h.capacity == 10
    with pytest.raises(ValueError, match="capacity"):
        h.set_capacity(0)


def test_mirror_gets_the_same_records():
    src, mirror = StepHistory(), StepHistory()
    sched = make_sched()
    sched.add_request(make_req("a", [1, 2, 3], max_tokens=5))
    for _ in range(3):
        _step(sched, src)
    snap = src.since(mirror.next_step)
    mirror.add(snap.records, snap.last_batch, snap.block_map)
    assert mirror.since(0).records == src.since(0).records and mirror.next_step == 3


def test_block_map_shows_owners_cached_and_free_blocks():
    sched = make_sched(num_blocks=16, block_size=4, caching=True)
    sched.add_request(make_req("a", list(range(9)), max_tokens=2))  # 3 blocks, 2 full (hashed)
    h = StepHistory(block_map_interval_s=0.0)
    _step(sched, h)
    m = h.since(0).block_map
    assert m.num_blocks == 16 and m.blocks_per_cell == 1 and m.legend == ["a"]
    assert sorted(c for c in m.cells if c != FREE) == [2, 2, 2]
    sched.finish_requests(["a"], sched.requests["a"].status.FINISHED_ABORTED)
    m = take_block_map(sched.block_manager, 0.0)
    assert m.legend == [] and m.cells.count(CACHED) == 2 and m.cells.count(FREE) == 14
    big = take_block_map(make_sched(num_blocks=5000).block_manager, 0.0, max_cells=1000)
    assert big.blocks_per_cell == 5 and len(big.cells) == 1000


def test_no_block_map_unless_asked():
    h = StepHistory()
    sched = make_sched()
    sched.add_request(make_req("a", [1, 2, 3]))
    _step(sched, h)
    assert h.since(0).block_map is None


def test_merged_record_sums_the_replicas_and_block_maps_sit_side_by_side():
    """Data parallelism (engine/dp_engine.py): one record per round, counts summed; an idle
    replica contributes its state with no tokens; the maps keep each request's own code."""
    from minivllm.engine.step_history import merge_block_maps, merge_records, state_record
    busy = make_sched(num_blocks=32, block_size=4, max_num_seqs=4, budget=16)
    idle = make_sched(num_blocks=32, block_size=4, max_num_seqs=4, budget=16)
    busy.add_request(make_req("a", list(range(10)), max_tokens=4))
    busy.add_request(make_req("b", list(range(5)), max_tokens=4))
    idle.add_request(make_req("c", list(range(3)), max_tokens=4))
    hist_busy, hist_idle = StepHistory(), StepHistory()
    _step(idle, hist_idle)  # c runs (holding a block) but does not step in the merged round
    _step(busy, hist_busy)
    rec = hist_busy.latest()
    still = state_record(0, 0.0, idle, idle.block_manager, 1)
    merged = merge_records(7, 1.5, [rec, still])
    assert (merged.step, merged.t) == (7, 1.5)
    assert (merged.num_seqs, merged.num_tokens, merged.prefill_tokens) == (2, 15, 15)
    assert (merged.num_running, merged.num_waiting) == (3, 0)
    assert merged.num_blocks == 64 and merged.token_budget == 32
    idle_used = idle.block_manager.num_blocks - idle.block_manager.num_free_blocks
    assert idle_used >= 1 and merged.kv_used_blocks == rec.kv_used_blocks + idle_used
    assert merged.generation_tokens_total == 1
    maps = [take_block_map(busy.block_manager, 0.0), take_block_map(idle.block_manager, 0.0)]
    both = merge_block_maps(maps, 2.0)
    assert both.num_blocks == 64 and both.cells[:32] == maps[0].cells and len(both.cells) == 64
    assert both.legend == maps[0].legend + maps[1].legend
    assert {c for c in both.cells[32:] if c >= 2} == {c + len(maps[0].legend) for c in maps[1].cells if c >= 2} \
        == {2 + len(maps[0].legend)}  # c keeps a code of its own after a and b's
