"""Disaggregated prefill/decode in the scheduler (pure Python): a producer holds a finished
request's blocks until the connector releases them; a consumer's request waits for its pull
(WAITING_FOR_REMOTE_KVS) while others run, then computes its last prompt token only; a failed
pull recomputes the prompt; an abort mid-pull frees the blocks and cancels the pull."""

from __future__ import annotations

import pytest

from minivllm.core.interfaces import RunnerOutput
from minivllm.core.request import RequestStatus
from minivllm.kv_transfer.params import RemotePrefill, parse, prompt_hash
from tests.unit.test_scheduler import make_req, make_sched

BS = 4
PROMPT = list(range(100, 110))  # 10 tokens: blocks of 4, 4, 2


def _remote(prompt=PROMPT, **kw) -> RemotePrefill:
    fields = dict(engine_id="p0", request_id="r", block_ids=(7, 8, 9), host="127.0.0.1", port=9,
                  num_tokens=len(prompt), block_size=BS, prompt_hash=prompt_hash(prompt))
    return RemotePrefill(**{**fields, **kw})


def _consumer(sched, rid="c", prompt=PROMPT, **kw):
    req = make_req(rid, prompt, max_tokens=4)
    req.remote_prefill = _remote(prompt, **kw)
    sched.add_request(req)
    return req


def test_a_producer_holds_a_finished_requests_blocks_until_they_are_released():
    sched = make_sched(block_size=BS, num_blocks=16)
    sched.kv_address = ("p0", "127.0.0.1", 5555)
    req = make_req("a", PROMPT, max_tokens=1)
    req.remote_decode = True
    sched.add_request(req)
    out = sched.schedule()
    updates = sched.update(out, RunnerOutput(["a"], [[5]]))
    assert updates[0].finished and req.status == RequestStatus.FINISHED_LENGTH
    held = sched.block_manager.block_ids("a")
    assert len(held) == 3 and sched.block_manager.num_free_blocks == 13  # not freed: pinned
    answer = req.kv_transfer_params_out
    assert answer["remote_block_ids"] == held and answer["num_tokens"] == 10 and answer["remote_port"] == 5555
    assert parse(answer)[1] == _remote(block_ids=tuple(held), port=5555, request_id="a")
    jobs = sched.take_kv_jobs()
    assert [(s.req_id, s.block_ids) for s in jobs.sends] == [("a", held)]
    assert sched.has_kv_transfers() and not sched.has_unfinished_requests()
    sched.finish_kv_transfers(["a"], {})
    assert sched.block_manager.num_free_blocks == 16 and not sched.has_kv_transfers()


def test_an_aborted_producer_request_frees_its_blocks_at_once():
    sched = make_sched(block_size=BS, num_blocks=16)
    sched.kv_address = ("p0", "127.0.0.1", 5555)
    req = make_req("a", PROMPT, max_tokens=1)
    req.remote_decode = True
    sched.add_request(req)
    sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.block_manager.num_free_blocks == 16 and not sched.take_kv_jobs().sends


def test_a_consumer_request_waits_for_its_pull_while_others_run_then_computes_its_last_token():
    sched = make_sched(block_size=BS, num_blocks=16)
    c = _consumer(sched)
    sched.add_request(make_req("other", [1, 2, 3]))
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["other"]  # c waits, the batch goes on
    assert c.status == RequestStatus.WAITING_FOR_REMOTE_KVS and c.request_id not in [n.req_id for n in out.new_requests]
    jobs = sched.take_kv_jobs()
    (pull,) = jobs.pulls
    # K/V of tokens 0..8 (the last prompt token is computed here): all 3 blocks, the last partly
    assert pull.local_block_ids == sched.block_manager.block_ids("c") and len(pull.local_block_ids) == 3
    assert pull.remote_block_ids == [7, 8, 9]
    sched.update(out, RunnerOutput(["other"], [[11]]))
    out = sched.schedule()
    assert "c" not in [s.req_id for s in out.scheduled]  # not pulled yet
    sched.update(out, RunnerOutput(["other"], [[12]]))
    sched.finish_kv_transfers([], {"c": True})
    out = sched.schedule()
    (s,) = [s for s in out.scheduled if s.req_id == "c"]
    assert s.token_ids == [PROMPT[-1]] and s.num_computed_tokens == 9 and s.samples
    assert s.new_block_ids == pull.local_block_ids  # the runner meets the request with its whole table
    assert "c" in [n.req_id for n in out.new_requests] and c.status == RequestStatus.RUNNING
    assert sched.num_kv_pull_failures == 0


def test_a_failed_pull_recomputes_the_prompt():
    sched = make_sched(block_size=BS, num_blocks=16)
    _consumer(sched)
    sched.schedule()
    sched.take_kv_jobs()
    sched.finish_kv_transfers([], {"c": False})
    assert sched.block_manager.num_free_blocks == 16  # the pull's blocks went back
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.token_ids == PROMPT and s.num_computed_tokens == 0
    assert sched.num_kv_pull_failures == 1 and not sched.take_kv_jobs().pulls


def test_an_abort_mid_pull_frees_the_blocks_and_cancels_the_pull():
    sched = make_sched(block_size=BS, num_blocks=16)
    _consumer(sched)
    sched.schedule()
    sched.take_kv_jobs()
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert sched.block_manager.num_free_blocks == 16 and sched.take_kv_jobs().cancels == ["c"]
    sched.finish_kv_transfers([], {"c": True})  # the connector's late news changes nothing
    assert sched.block_manager.num_free_blocks == 16 and not sched.has_unfinished_requests()


@pytest.mark.parametrize("bad", [dict(prompt_hash="x"), dict(num_tokens=9), dict(block_size=8),
                                 dict(block_ids=(7, 8))])
def test_remote_kv_that_does_not_fit_the_request_is_recomputed_and_released(bad):
    sched = make_sched(block_size=BS, num_blocks=16)
    _consumer(sched, **bad)
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.token_ids == PROMPT and s.num_computed_tokens == 0
    (pull,) = sched.take_kv_jobs().pulls
    assert pull.remote_block_ids == [] and pull.local_block_ids == []  # the producer only releases
    assert sched.num_kv_pull_failures == 1


def test_a_local_prefix_hit_pulls_only_the_rest():
    sched = make_sched(block_size=BS, num_blocks=16, caching=True)
    sched.add_request(make_req("warm", PROMPT[:8] + [1, 2], max_tokens=1))
    out = sched.schedule()
    sched.update(out, RunnerOutput(["warm"], [[5]]))  # finished: its 2 full blocks stay cached
    _consumer(sched)
    sched.schedule()
    (pull,) = sched.take_kv_jobs().pulls
    assert pull.remote_block_ids == [9] and len(pull.local_block_ids) == 1
    assert sched.requests["c"].num_cached_tokens == 8


def test_kv_transfer_params_errors_name_the_field():
    with pytest.raises(ValueError, match="kv_transfer_params.remote_block_ids"):
        parse({"do_remote_prefill": True, "remote_block_ids": [-1]})
    with pytest.raises(ValueError, match="kv_transfer_params.remote_port"):
        parse({"do_remote_prefill": True, "remote_block_ids": [], "remote_engine_id": "e", "remote_request_id": "r",
               "remote_host": "h", "remote_port": 0})
    with pytest.raises(ValueError, match="cannot both be true"):
        parse({"do_remote_prefill": True, "do_remote_decode": True})
    assert parse({"do_remote_decode": True}) == (True, None) and parse(None) == (False, None)


def test_pulled_blocks_count_only_pulls_that_succeeded():
    sched = make_sched(block_size=BS, num_blocks=16)
    _consumer(sched, rid="ok")
    _consumer(sched, rid="bad")
    sched.schedule()
    assert sched.num_kv_pulled_blocks == 0  # started, not arrived
    sched.finish_kv_transfers([], {"ok": True, "bad": False})
    assert sched.num_kv_pulled_blocks == 3 and sched.num_kv_pull_failures == 1
