"""Swap preemption and the prefix cache's offload tier in the core (no torch): the scheduler
driven by test_scheduler's FakeRunner, which makes every block copy of SchedulerOutput.kv_transfers
on its own token-level model of the pools and checks that a resumed request or a prefix hit finds
its own tokens in its blocks. Nothing leaks: every device and host block is free at the end."""

from __future__ import annotations

from test_scheduler import FakeRunner, make_req

from minivllm.core.block_manager import BlockManager
from minivllm.core.offload_cache import OffloadCache
from minivllm.core.scheduler import Scheduler, SchedulerLimits
from minivllm.core.request import RequestStatus
from minivllm.core.swap_space import HostBlockPool, SwapCosts, SwapSpace


def swap_sched(mode: str | None, *, num_blocks: int = 12, swap_blocks: int = 32,
               costs: SwapCosts | None = None) -> Scheduler:
    return Scheduler(SchedulerLimits(8, 64, 256), BlockManager(num_blocks, 4, False),
                     SwapSpace(swap_blocks, mode, costs))


def run_crowd(sched: Scheduler, n: int = 4) -> FakeRunner:
    script = {f"r{i}": [50 + i + k for k in range(12)] for i in range(n)}
    runner = FakeRunner(sched, script)
    for i in range(n):
        sched.add_request(make_req(f"r{i}", list(range(100 + 10 * i, 110 + 10 * i)), max_tokens=12))
    runner.run_until_done()
    return runner


def assert_nothing_leaks(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.req_blocks
    if sched.swap is not None:
        assert sched.swap.pool.num_free == sched.swap.pool.num_blocks and not sched.swap.swapped
    if bm.offload is not None:
        assert bm.offload.pool.num_free + len(bm.offload.blocks) == bm.offload.pool.num_blocks


def test_swap_mode_keeps_computed_tokens_and_resumes_from_host():
    sched = swap_sched("swap")
    runner = run_crowd(sched)
    swap = sched.swap
    assert sched.num_preemptions > 0 and swap.num_blocks_swapped_out > 0
    assert swap.num_blocks_swapped_in == swap.num_blocks_swapped_out
    assert sched.requests == {}
    assert_nothing_leaks(sched)


def test_swapped_request_resumes_at_its_computed_tokens():
    sched = swap_sched("swap", num_blocks=8)
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", list(range(100, 110)), max_tokens=12))
    sched.add_request(make_req("b", list(range(200, 210)), max_tokens=12))
    resumed = None
    for _ in range(60):
        out, _ = runner.step()
        t = out.kv_transfers
        if t is not None and t.swap_in:
            (s,) = [s for s in out.scheduled if s.new_block_ids and s.new_block_ids[0] == t.swap_in[0][1]]
            resumed = s
            break
    assert resumed is not None, "the pool was meant to force a swap"
    req = sched.requests[resumed.req_id]
    # everything but the last known token came back from the host: that one is computed again
    # (and the step sampled one more)
    assert resumed.samples and len(resumed.token_ids) == 1
    assert resumed.num_computed_tokens == req.num_tokens - 2 > 4
    runner.run_until_done()
    assert_nothing_leaks(sched)


def test_recompute_mode_never_swaps():
    sched = swap_sched("recompute")
    run_crowd(sched)
    assert sched.num_preemptions > 0 and sched.swap.num_blocks_swapped_out == 0
    assert_nothing_leaks(sched)


def test_full_swap_space_falls_back_to_recompute():
    sched = swap_sched("swap", swap_blocks=2)
    run_crowd(sched)
    assert sched.num_preemptions > 0
    assert sched.swap.num_blocks_swapped_out <= sched.num_preemptions * 2
    assert_nothing_leaks(sched)


def test_cost_choice():
    cheap_copy = SwapCosts(recompute_s_per_token=1e-3, copy_s_per_block=1e-3)
    space = SwapSpace(8, None, cheap_copy)
    assert space.should_swap(16, 4)  # 16 ms of recompute vs 8 ms of copies out and in
    assert not space.should_swap(6, 4)  # 6 ms: recomputing beats the copies
    assert not space.should_swap(1000, 9)  # does not fit: recompute
    assert not SwapSpace(8, "recompute", cheap_copy).should_swap(1000, 1)
    assert SwapSpace(8, "swap", SwapCosts(1.0, 1e9)).should_swap(1, 1)  # forced, whatever the cost
    # unset mode under the scheduler: the cost model picks swap for these prompts
    sched = swap_sched(None, costs=cheap_copy)
    run_crowd(sched)
    assert sched.swap.num_blocks_swapped_out > 0
    assert_nothing_leaks(sched)


def _two_until_one_is_swapped() -> tuple[Scheduler, FakeRunner, str]:
    """Two requests that do not fit together, stepped until one of them is swapped out."""
    sched = swap_sched("swap", num_blocks=8)
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", list(range(100, 110)), max_tokens=12))
    sched.add_request(make_req("b", list(range(200, 210)), max_tokens=12))
    for _ in range(60):
        runner.step()
        if sched.swap.swapped:
            break
    (rid,) = sched.swap.swapped
    return sched, runner, rid


def test_aborting_a_swapped_request_frees_its_host_blocks():
    sched, runner, rid = _two_until_one_is_swapped()
    sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
    assert sched.swap.pool.num_free == sched.swap.pool.num_blocks
    runner.run_until_done()
    assert_nothing_leaks(sched)


def test_requeue_drops_a_swap_copied_after_a_failed_step():
    sched, runner, rid = _two_until_one_is_swapped()
    sched.requeue([rid])  # the step that wrote its blocks failed: recompute, not swap in
    assert not sched.swap.swapped and sched.requests[rid].num_computed_tokens == 0
    runner.run_until_done()
    assert_nothing_leaks(sched)


# ---- the offload tier ---------------------------------------------------------------------------

def offload_sched(num_blocks: int = 10, host_blocks: int = 16) -> Scheduler:
    return Scheduler(SchedulerLimits(8, 64, 256), BlockManager(num_blocks, 4, True, offload=OffloadCache(host_blocks)))


def test_evicted_prefix_is_loaded_back_from_host():
    sched = offload_sched(host_blocks=64)
    runner = FakeRunner(sched)
    bm = sched.block_manager
    shared = list(range(100, 116))  # 4 full blocks
    sched.add_request(make_req("a", shared + [1], max_tokens=2))
    runner.run_until_done()
    for i in range(3):  # other prompts evict the shared prefix from the device
        sched.add_request(make_req(f"x{i}", list(range(300 + 40 * i, 336 + 40 * i)), max_tokens=2))
        runner.run_until_done()
    assert bm.offload.num_stored_blocks >= 4
    hits_before = bm.prefix_hits
    sched.add_request(make_req("b", shared + [2], max_tokens=2))
    out, _ = runner.step()  # FakeRunner checks the loaded blocks hold b's prompt tokens
    assert len(out.kv_transfers.load) == 4 and bm.offload.num_loaded_blocks == 4
    assert out.scheduled[0].num_computed_tokens == 16 and bm.prefix_hits - hits_before == 16
    runner.run_until_done()
    assert_nothing_leaks(sched)


def test_small_offload_tier_keeps_the_most_recent_blocks():
    sched = offload_sched(host_blocks=6)
    runner = FakeRunner(sched)
    bm = sched.block_manager
    for i in range(6):  # each prompt evicts the one before it
        sched.add_request(make_req(f"x{i}", list(range(300 + 40 * i, 336 + 40 * i)), max_tokens=2))
        runner.run_until_done()
    assert bm.offload.num_stored_blocks > 6 and len(bm.offload.blocks) == 6
    # the oldest prompt is gone from both tiers: computed again; a recent one partly loads
    sched.add_request(make_req("again0", list(range(300, 336)), max_tokens=2))
    out, _ = runner.step()
    assert out.kv_transfers is None or not out.kv_transfers.load
    runner.run_until_done()
    assert_nothing_leaks(sched)


def test_offload_lru_never_overwrites_a_block_loaded_in_the_same_step():
    cache = OffloadCache(2)
    cache.store(b"a", 0)
    cache.store(b"b", 1)
    cache.take_transfers()
    cache.load(b"a", 5)  # pinned until the step's copies are taken
    cache.store(b"c", 2)  # evicts b (a is newer and pinned)
    cache.store(b"d", 3)  # evicts c, again not a (copies run in order: host block 1 ends up d's)
    stores, loads = cache.take_transfers()
    assert loads == [(0, 5)] and stores == [(2, 1), (3, 1)]
    assert list(cache.blocks) == [b"a", b"d"]
    cache.load(b"a", 6)
    cache.load(b"d", 7)
    cache.store(b"e", 4)  # every host block is read this step: dropped
    assert cache.take_transfers() == ([], [(0, 6), (1, 7)]) and b"e" not in cache


def test_host_block_pool():
    pool = HostBlockPool(3)
    a = pool.allocate(2)
    assert pool.allocate(2) is None and pool.num_free == 1
    pool.free(a)
    assert pool.num_free == 3 and sorted(pool.allocate(3)) == [0, 1, 2]


def test_host_pools_larger_than_the_available_memory_fail_at_startup():
    import psutil
    import pytest

    from minivllm.engine.config_builder import resolve_host_kv
    gib = psutil.virtual_memory().total * 2 / (1 << 30)
    with pytest.raises(ValueError, match=r"swap_space \+ kv_offloading_size \(.* GiB\) must fit in the host memory"):
        resolve_host_kv(gib, "swap", None, True)
    assert resolve_host_kv(1.0, "swap", 0.5, True) == (1 << 30, 1 << 29)
