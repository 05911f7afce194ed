"""Pipeline parallelism in the scheduler (max_concurrent_batches > 1): a request in a batch not yet
updated is neither scheduled again nor preempted; others fill the next batch meanwhile."""

from __future__ import annotations

from minivllm.core.block_manager import BlockManager
from minivllm.core.interfaces import RunnerOutput
from minivllm.core.request import Request
from minivllm.core.scheduler import Scheduler, SchedulerLimits
from minivllm.sampling_params import SamplingParams


def _sched(num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerLimits(8, 64, 256, max_concurrent_batches=2), BlockManager(num_blocks, 4, False))


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=8), frozenset({0}), 0.0, 8)


def _sampled(out) -> RunnerOutput:
    ids = [s.req_id for s in out.scheduled if s.samples]
    return RunnerOutput(ids, [[7] for _ in ids])


def test_a_request_in_flight_is_not_scheduled_again():
    s = _sched()
    s.add_request(_req("a", 5))
    first = s.schedule()
    assert [x.req_id for x in first.scheduled] == ["a"]
    s.add_request(_req("b", 3))
    second = s.schedule()  # a is still in the pipeline: only b
    assert [x.req_id for x in second.scheduled] == ["b"]
    assert s.schedule().is_empty  # both in flight
    s.update(first, _sampled(first))
    third = s.schedule()
    assert [x.req_id for x in third.scheduled] == ["a"]
    assert third.scheduled[0].token_ids == [7]  # the real token, no placeholder


def test_a_request_in_flight_is_never_the_preemption_victim():
    s = _sched(num_blocks=3)  # 12 tokens
    s.add_request(_req("a", 4))
    first = s.schedule()  # a: one full block
    s.add_request(_req("b", 7))
    second = s.schedule()  # b: two blocks, the cache is full
    assert [x.req_id for x in second.scheduled] == ["b"]
    s.update(first, _sampled(first))
    third = s.schedule()  # a needs a block; b is in flight, so a itself goes back to waiting
    assert third.is_empty and third.preempted_req_ids == {"a"}
    assert [r.request_id for r in s.running] == ["b"]


def test_batches_split_the_requests_between_the_stages():
    """Four requests and two stages: two per batch, so the second stage is never left without
    a batch (one batch of all four would leave the other stage idle every step)."""
    s = _sched()
    for rid in "abcd":
        s.add_request(_req(rid, 3))
    first, second = s.schedule(), s.schedule()
    assert len(first.scheduled) == 2 and len(second.scheduled) == 2
    assert {x.req_id for x in first.scheduled} | {x.req_id for x in second.scheduled} == set("abcd")
    assert s.schedule().is_empty  # every request in flight
    s.update(first, _sampled(first))
    third = s.schedule()  # the first batch's requests, decoding now
    assert {x.req_id for x in third.scheduled} == {x.req_id for x in first.scheduled}
    assert all(len(x.token_ids) == 1 for x in third.scheduled)
