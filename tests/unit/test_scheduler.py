"""Scheduler: driven step by step with hand-made RunnerOutputs, no torch.

`FakeRunner` plays the model runner's side of the plain-data protocol: it keeps its own copy of
every request's tokens and block table from `SchedulerOutput` alone (new/finished/preempted ids,
new block ids, token ids) and checks every scheduled chunk against that copy, then "samples" the
next token from a per-request script. So the tests also check that the scheduler never sends
the runner something it could not compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.core.block_manager import BlockManager
from minivllm.core.interfaces import RunnerOutput, SchedulerOutput
from minivllm.core.request import PromptGroup, Request, RequestStatus
from minivllm.core.scheduler import Scheduler, SchedulerLimits
from minivllm.sampling_params import SamplingParams

EOS = 2
DEFAULT_TOKEN = 7


def make_sched(*, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
               max_model_len: int = 256, policy: str = "fcfs", chunked: bool = True,
               caching: bool = False, prefill_cap: int | None = None, lookahead: int = 0) -> Scheduler:
    return Scheduler(SchedulerLimits(max_num_seqs, budget, max_model_len, policy, chunked, prefill_cap, lookahead),
                     BlockManager(num_blocks, block_size, caching))


def make_req(rid: str, prompt: list[int], *, max_tokens: int = 8, priority: int = 0, arrival: float = 0.0,
             eos: tuple[int, ...] = (EOS,), group: PromptGroup | None = None, sample_index: int = 0,
             **params) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), frozenset(eos), arrival,
                   max_tokens, priority=priority, sample_index=sample_index, group=group)


@dataclass
class _RunnerReq:
    tokens: list[int]
    num_computed: int | None = None  # None until first scheduled (a prefix hit starts past 0)
    table: list[int] = field(default_factory=list)
    num_outputs: int = 0


class FakeRunner:
    """Checks the SchedulerOutput protocol and samples scripted tokens: the k-th output token of
    request r is script[r][k] (DEFAULT_TOKEN past the end of the script).

    `kv[block_id][slot]` is the token whose K/V the runner wrote there: a chunk may only start
    past 0 (a prefix hit) if the blocks it skips really hold the request's tokens."""

    def __init__(self, sched: Scheduler, script: dict[str, list[int]] | None = None, propose=None) -> None:
        """propose(req_id, k_th output next) -> draft tokens for the request's next step, or None:
        no speculative decoding. Drafts are verified against the script (the "target")."""
        self.propose = propose
        self.sched = sched
        self.bs = sched.block_manager.block_size
        self.script = script or {}
        self.state: dict[str, _RunnerReq] = {}
        self.kv: list[list[int | None]] = [[None] * self.bs for _ in range(sched.block_manager.num_blocks)]
        # host pools (swap space, offload tier): block id -> the tokens its slots hold
        self.host: dict[str, dict[int, list[int | None]]] = {"swap": {}, "offload": {}}
        self.steps = 0

    def _copy_blocks(self, out: SchedulerOutput) -> set[int]:
        """Make the step's KV block copies, to the host first (as the runner does); returns the
        device blocks a swap-in filled."""
        t = out.kv_transfers
        if t is None:
            return set()
        for pairs, pool in ((t.swap_out, "swap"), (t.offload, "offload")):
            for dev, host in pairs:
                self.host[pool][host] = list(self.kv[dev])
        for pairs, pool in ((t.swap_in, "swap"), (t.load, "offload")):
            for host, dev in pairs:
                self.kv[dev] = list(self.host[pool][host])
        return {dev for _, dev in t.swap_in}

    def token_for(self, rid: str, k: int) -> int:
        s = self.script.get(rid, [])
        return s[k] if k < len(s) else DEFAULT_TOKEN

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        swapped_in = self._copy_blocks(out)
        for rid in out.finished_req_ids | out.preempted_req_ids:
            assert rid in self.state, f"runner told to drop unknown request {rid}"
            del self.state[rid]
        for nr in out.new_requests:
            assert nr.req_id not in self.state, f"{nr.req_id} sent as new while the runner still holds it"
            self.state[nr.req_id] = _RunnerReq(list(nr.prompt_token_ids) + list(nr.output_token_ids),
                                               num_outputs=len(nr.output_token_ids))
        assert out.num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.num_scheduled_tokens <= self.sched.limits.max_num_batched_tokens
        assert len({s.req_id for s in out.scheduled}) == len(out.scheduled)
        req_ids, tokens, drafts = [], [], {}
        for s in out.scheduled:
            st_ = self.state[s.req_id]
            nd = s.num_draft_tokens
            assert nd == 0 or self.propose is not None
            first_fresh = len(st_.table) if st_.num_computed is not None else s.num_computed_tokens // self.bs
            resumed = st_.num_computed is None and bool(swapped_in & set(s.new_block_ids))
            if resumed:  # swapped back in: its blocks up to the one holding num_computed_tokens hold its KV
                first_fresh = -(-s.num_computed_tokens // self.bs)
            st_.table += s.new_block_ids
            for b in st_.table[first_fresh:]:  # fresh blocks (not prefix hits) hold nothing yet
                self.kv[b] = [None] * self.bs
            if st_.num_computed is None:  # first chunk: the cached prefix must hold our tokens
                st_.num_computed = s.num_computed_tokens
                assert (st_.num_computed % self.bs == 0 or resumed) and st_.num_computed < len(st_.tokens)
                for i in range(st_.num_computed):
                    assert self.kv[st_.table[i // self.bs]][i % self.bs] == st_.tokens[i], "bad prefix hit"
            assert s.num_computed_tokens == st_.num_computed
            assert len(s.token_ids) > 0
            known = len(s.token_ids) - nd
            assert s.token_ids[:known] == st_.tokens[st_.num_computed:st_.num_computed + known]
            assert len(st_.table) * self.bs >= st_.num_computed + len(s.token_ids), "KV slots without a block"
            written = st_.tokens[st_.num_computed:st_.num_computed + known] + s.token_ids[known:]
            for i, tok in enumerate(written, st_.num_computed):
                blk = self.sched.block_manager.blocks[st_.table[i // self.bs]]
                if blk.ref_cnt > 1 or blk.block_hash is not None:
                    # registered (and maybe shared) in the step that computes it: the content
                    # written must be what the hash promises, never different tokens (nor drafts)
                    assert i - st_.num_computed < known, "a draft written into a cached block"
                    assert self.kv[blk.block_id][i % self.bs] in (None, tok), "overwriting cached KV"
                self.kv[blk.block_id][i % self.bs] = tok
            st_.num_computed += known
            assert st_.table == self.sched.block_manager.block_ids(s.req_id)
            assert s.samples == (st_.num_computed == len(st_.tokens))
            if s.samples:
                new = self._verify(s.req_id, st_, s.token_ids[known:])
                for i in range(st_.num_computed, st_.num_computed + nd + 1 - len(new)):  # rejected drafts:
                    self.kv[st_.table[i // self.bs]][i % self.bs] = None  # junk no hash ever promised
                req_ids.append(s.req_id)
                tokens.append(new)
                if self.propose is not None:
                    drafts[s.req_id] = self.propose(s.req_id, st_.num_outputs)
            else:
                assert nd == 0, "drafts on a step that does not sample"
        return RunnerOutput(req_ids, tokens, draft_token_ids=drafts or None)

    def _verify(self, rid: str, st_: _RunnerReq, draft: list[int]) -> list[int]:
        """The target's tokens: drafts while they equal the script, then the script's next one.
        The accepted drafts' K/V were written above; the rejected ones' slots hold junk."""
        new = []
        for d in draft:
            if d != self.token_for(rid, st_.num_outputs + len(new)):
                break
            new.append(d)
        new.append(self.token_for(rid, st_.num_outputs + len(new)))
        st_.num_computed += len(new) - 1  # the accepted drafts are computed
        st_.tokens += new
        st_.num_outputs += len(new)
        return new

    def step(self):
        out = self.sched.schedule()
        updates = self.sched.update(out, self.execute(out))
        return out, updates

    def run_until_done(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")


def scheduled(out: SchedulerOutput) -> dict[str, list[int]]:
    return {s.req_id: s.token_ids for s in out.scheduled}


def num_referenced(sched: Scheduler) -> int:
    return sum(1 for b in sched.block_manager.blocks if b.ref_cnt > 0)


# ---- basic scheduling -------------------------------------------------------------------------

def test_prompt_scheduled_whole_when_it_fits_then_decodes():
    sched = make_sched(budget=64)
    runner = FakeRunner(sched, {"a": [11, 12, 13]})
    prompt = list(range(100, 110))
    sched.add_request(make_req("a", prompt, max_tokens=3))
    out, updates = runner.step()
    assert [n.req_id for n in out.new_requests] == ["a"]
    assert len(out.scheduled) == 1
    s = out.scheduled[0]
    assert s.token_ids == prompt and s.num_computed_tokens == 0 and s.samples
    assert len(s.new_block_ids) == 3  # ceil(10 / 4)
    assert out.num_scheduled_tokens == 10
    assert [(u.request.request_id, u.new_token_ids, u.finished) for u in updates] == [("a", [11], False)]
    out, updates = runner.step()
    assert out.new_requests == []
    assert out.scheduled[0].token_ids == [11] and out.scheduled[0].num_computed_tokens == 10
    assert out.scheduled[0].new_block_ids == []
    out, updates = runner.step()
    assert updates[0].finished and updates[0].request.output_token_ids == [11, 12, 13]


def test_chunked_prefill_splits_prompt_and_samples_on_last_chunk():
    sched = make_sched(budget=10)
    runner = FakeRunner(sched, {"a": [40]})
    prompt = list(range(100, 125))  # 25 tokens
    sched.add_request(make_req("a", prompt, max_tokens=2))
    chunks = []
    for _ in range(3):
        out, updates = runner.step()
        (s,) = out.scheduled
        assert out.num_scheduled_tokens <= 10
        chunks.append((s.num_computed_tokens, len(s.token_ids), s.samples, [u.new_token_ids for u in updates]))
    assert chunks == [(0, 10, False, []), (10, 10, False, []), (20, 5, True, [[40]])]
    req = sched.requests["a"]
    assert req.num_computed_tokens == 25 and req.output_token_ids == [40]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_the_rest_of_the_budget_waits():
    sched = make_sched(budget=10, chunked=False)
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", [1] * 6))
    sched.add_request(make_req("b", [3] * 6))
    out, _ = runner.step()
    assert scheduled(out) == {"a": [1] * 6}
    assert sched.num_waiting == 1
    out, _ = runner.step()
    assert scheduled(out) == {"a": [DEFAULT_TOKEN], "b": [3] * 6}


def test_decodes_first_then_waiting_prefill_chunks_in_the_same_step():
    sched = make_sched(budget=10)
    runner = FakeRunner(sched, {"a": [21, 22, 23]})
    sched.add_request(make_req("a", list(range(8))))
    runner.step()
    sched.add_request(make_req("b", list(range(50, 70))))  # 20 tokens
    out, updates = runner.step()
    assert [(s.req_id, len(s.token_ids), s.samples) for s in out.scheduled] == [("a", 1, True), ("b", 9, False)]
    assert out.num_scheduled_tokens == 10
    assert [u.request.request_id for u in updates] == ["a"]
    out, _ = runner.step()  # b's unfinished prefill is a running request now, still after a's decode
    assert [(s.req_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 9)]


def test_prefill_cap_chunks_a_prompt_beside_decoding_requests():
    sched = make_sched(budget=64, prefill_cap=10, max_num_seqs=8)
    runner = FakeRunner(sched)
    sched.add_request(make_req("d", [1, 3, 4], max_tokens=20))
    runner.step()  # "d" decodes from now on
    sched.add_request(make_req("p", list(range(100, 125)), max_tokens=2))  # 25 prompt tokens
    sizes = []
    for _ in range(3):
        out, _ = runner.step()
        sizes.append({s.req_id: len(s.token_ids) for s in out.scheduled})
    # the decode goes on every step; the prompt comes in chunks of at most the cap
    assert sizes == [{"d": 1, "p": 10}, {"d": 1, "p": 10}, {"d": 1, "p": 5}]
    assert sched.requests["p"].num_output_tokens == 1
    runner.run_until_done()


def test_prefill_cap_is_off_without_decodes_and_half_the_budget_under_a_backlog():
    # nothing decoding yet: the first prompt takes the whole budget
    sched = make_sched(budget=64, prefill_cap=10)
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", list(range(100, 140)), max_tokens=4))
    out, _ = runner.step()
    assert scheduled(out) == {"a": list(range(100, 140))}
    # "a" decodes, and more requests wait than LIGHT_LOAD_WAITING: a backlog, half the budget
    from minivllm.core.scheduler import LIGHT_LOAD_WAITING
    for i in range(LIGHT_LOAD_WAITING + 1):
        sched.add_request(make_req(f"w{i}", list(range(200 + 10 * i, 211 + 10 * i)), max_tokens=2))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == 1 + 32  # "a" decodes; 11 + 11 + 10 prompt tokens
    assert [len(s.token_ids) for s in out.scheduled] == [1, 11, 11, 10]
    runner.run_until_done()


def test_prefill_cap_is_off_without_chunked_prefill():
    sched = make_sched(budget=64, prefill_cap=10, chunked=False)
    runner = FakeRunner(sched)
    sched.add_request(make_req("d", [1, 3, 4], max_tokens=20))
    runner.step()
    sched.add_request(make_req("p", list(range(100, 125)), max_tokens=2))
    out, _ = runner.step()  # a prompt that may not be chunked is scheduled whole, never starved
    assert {s.req_id: len(s.token_ids) for s in out.scheduled} == {"d": 1, "p": 25}


def test_max_num_seqs_caps_running_requests():
    sched = make_sched(max_num_seqs=2)
    runner = FakeRunner(sched)
    for rid, mt in (("a", 1), ("b", 3), ("c", 2)):
        sched.add_request(make_req(rid, [5, 6, 7], max_tokens=mt))
    out, _ = runner.step()
    assert set(scheduled(out)) == {"a", "b"}
    assert sched.num_running == 1 and sched.num_waiting == 1  # a finished (max_tokens=1)
    out, _ = runner.step()
    assert set(scheduled(out)) == {"b", "c"} and out.finished_req_ids == {"a"}
    for _ in range(5):
        assert sched.num_running <= 2
        runner.step()
    assert not sched.has_unfinished_requests()


# ---- stopping -------------------------------------------------------------------------------

def _finish(sched: Scheduler, req: Request, script: list[int]) -> Request:
    runner = FakeRunner(sched, {req.request_id: script})
    sched.add_request(req)
    runner.run_until_done()
    assert req.is_finished
    assert num_referenced(sched) == 0
    return req


def test_max_tokens_finishes_with_length():
    req = _finish(make_sched(), make_req("a", [1, 3], max_tokens=3), [5, 6, 7, 8])
    assert req.output_token_ids == [5, 6, 7]
    assert req.status == RequestStatus.FINISHED_LENGTH and req.status.finish_reason == "length"


def test_max_model_len_finishes_with_length():
    req = _finish(make_sched(max_model_len=6), make_req("a", [1, 3, 4, 5], max_tokens=10), [5, 6, 7, 8])
    assert req.output_token_ids == [5, 6]
    assert req.status.finish_reason == "length"


def test_eos_finishes_with_stop():
    req = _finish(make_sched(), make_req("a", [1], max_tokens=10, eos=(EOS, 3)), [5, 3, 6])
    assert req.output_token_ids == [5, 3]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.status.finish_reason == "stop"


def test_ignore_eos():
    req = _finish(make_sched(), make_req("a", [1], max_tokens=4, ignore_eos=True), [EOS, EOS, 5, EOS, 9])
    assert req.output_token_ids == [EOS, EOS, 5, EOS]
    assert req.status.finish_reason == "length"


def test_stop_token_ids_finish_with_stop_and_stop_reason():
    req = _finish(make_sched(), make_req("a", [1], max_tokens=10, stop_token_ids=[9], ignore_eos=True),
                  [5, EOS, 9, 6])
    assert req.output_token_ids == [5, EOS, 9]
    assert req.status.finish_reason == "stop" and req.stop_reason == 9


@pytest.mark.parametrize("stop_kw", [{}, {"stop_token_ids": [EOS]}])
@pytest.mark.parametrize("script,expected", [([EOS, EOS, EOS, 5], [EOS, EOS, EOS]),
                                             ([EOS, 5, 6, EOS, 6], [EOS, 5, 6, EOS])])
def test_min_tokens_delays_stop(stop_kw, script, expected):
    eos = (EOS,) if not stop_kw else ()
    req = _finish(make_sched(), make_req("a", [1], max_tokens=10, min_tokens=3, eos=eos, **stop_kw), script)
    assert req.output_token_ids == expected
    assert req.status.finish_reason == "stop"


def test_finished_request_is_reported_once_and_its_blocks_are_freed():
    sched = make_sched()
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", [1, 2, 3, 4, 5], max_tokens=1))
    out, updates = runner.step()
    assert updates[0].finished and num_referenced(sched) == 0
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()


# ---- preemption -------------------------------------------------------------------------------

def test_preemption_fcfs_newest_is_preempted_and_resumes_without_losing_tokens():
    # 4 blocks of 4 tokens: two requests of 7 prompt tokens fill them after one decode each
    sched = make_sched(num_blocks=4, block_size=4, budget=64)
    script = {"a": [31, 32, 33, 34], "b": [41, 42, 43, 44, 45]}
    runner = FakeRunner(sched, script)
    sched.add_request(make_req("a", list(range(100, 107)), max_tokens=4))
    sched.add_request(make_req("b", list(range(200, 207)), max_tokens=5))
    runner.step()  # both prefills: 8 tokens each, 2 blocks each
    runner.step()  # both decode within their 2nd block: 9 tokens each
    assert sched.block_manager.num_free_blocks == 0
    b = sched.requests["b"]
    assert b.output_token_ids == [41, 42]
    out, _ = runner.step()  # a needs a 3rd block: b (newest) is preempted
    assert out.preempted_req_ids == {"b"}
    assert "b" not in scheduled(out) and "a" in scheduled(out)
    assert out.new_requests == []
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert sched.block_manager.block_ids("b") == []
    assert b.output_token_ids == [41, 42]  # kept for the recompute
    assert sched.num_waiting == 1 and sched.num_running == 1
    resumed = None
    while resumed is None:
        out, _ = runner.step()
        resumed = next((n for n in out.new_requests if n.req_id == "b"), None)
    assert out.finished_req_ids == {"a"}
    assert resumed.output_token_ids == [41, 42] and resumed.prompt_token_ids == list(range(200, 207))
    s = next(s for s in out.scheduled if s.req_id == "b")
    assert s.num_computed_tokens == 0 and s.token_ids == list(range(200, 207)) + [41, 42] and s.samples
    assert b.output_token_ids == [41, 42, 43]
    runner.run_until_done()
    assert b.output_token_ids == script["b"] and b.status.finish_reason == "length"
    assert sched.requests == {} and num_referenced(sched) == 0


def test_preemption_with_chunked_recompute():
    """A resumed request whose prompt + output exceeds the budget recomputes in chunks and samples
    only at the end."""
    sched = make_sched(num_blocks=4, block_size=4, budget=6)
    runner = FakeRunner(sched, {"b": [41, 42, 43]})
    sched.add_request(make_req("a", list(range(100, 106)), max_tokens=6))
    b = make_req("b", list(range(200, 206)), max_tokens=3)
    sched.add_request(b)
    preempted = False
    for _ in range(40):
        out, _ = runner.step()
        preempted |= "b" in out.preempted_req_ids
        if not sched.has_unfinished_requests():
            break
    assert preempted
    assert b.output_token_ids == [41, 42, 43]
    assert sched.requests == {} and num_referenced(sched) == 0


def test_priority_preempts_least_important_running_request():
    sched = make_sched(num_blocks=6, block_size=4, policy="priority")
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", list(range(7)), priority=0, arrival=0.0, max_tokens=8))
    sched.add_request(make_req("b", list(range(7)), priority=5, arrival=1.0, max_tokens=8))
    runner.step()  # a, b: 8 tokens, 2 blocks each
    sched.add_request(make_req("c", list(range(7)), priority=1, arrival=2.0, max_tokens=8))
    runner.step()  # a, b: 9 tokens; c: 8 tokens; 2 blocks each
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
    assert sched.block_manager.num_free_blocks == 0
    out, _ = runner.step()  # a needs a 3rd block
    assert out.preempted_req_ids == {"b"}  # the least important, not the newest (c)
    assert set(scheduled(out)) == {"a", "c"}
    assert sched.requests["b"].status == RequestStatus.PREEMPTED


def test_priority_preempts_a_request_already_scheduled_in_this_step():
    """The victim may sit before the request that needs blocks: its chunk leaves the output and its
    tokens go back to the budget."""
    sched = make_sched(num_blocks=4, block_size=4, policy="priority")
    runner = FakeRunner(sched)
    sched.add_request(make_req("low", list(range(5)), priority=9, arrival=0.0))
    runner.step()  # low: 6 tokens, 2 blocks
    sched.add_request(make_req("high", list(range(50, 57)), priority=0, arrival=1.0))
    runner.step()  # low: 7 tokens; high: 8 tokens; 2 blocks each, none free
    runner.step()  # low: 8 tokens; high: 9 tokens
    out, _ = runner.step()  # low's decode fits its 2 blocks and is scheduled first; high needs a 3rd
    assert out.preempted_req_ids == {"low"}
    assert [s.req_id for s in out.scheduled] == ["high"]
    assert out.num_scheduled_tokens == 1
    assert sched.block_manager.block_ids("low") == []
    low = sched.requests["low"]
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    runner.run_until_done()
    assert low.output_token_ids == [DEFAULT_TOKEN] * 8


def test_tokens_of_a_preempted_victim_go_back_to_the_budget():
    sched = make_sched(num_blocks=3, block_size=8, budget=4, policy="priority")
    runner = FakeRunner(sched)
    sched.add_request(make_req("low", [1], priority=9, arrival=0.0))
    runner.step()
    sched.add_request(make_req("high", list(range(10, 18)), priority=0, arrival=1.0))
    runner.step()  # low decodes, high prefills 3 of 8
    sched.add_request(make_req("x", list(range(40, 44)), priority=1, arrival=2.0, max_tokens=2))
    out, _ = runner.step()
    assert [(s.req_id, len(s.token_ids)) for s in out.scheduled] == [("low", 1), ("high", 3)]
    out, _ = runner.step()
    assert [(s.req_id, len(s.token_ids)) for s in out.scheduled] == [("low", 1), ("high", 2), ("x", 1)]
    out, _ = runner.step()  # low is scheduled, then high's decode needs a 2nd block: low is preempted
    assert out.preempted_req_ids == {"low"}
    # low's token is given back: x's chunk uses the whole remaining budget
    assert [(s.req_id, len(s.token_ids)) for s in out.scheduled] == [("high", 1), ("x", 3)]
    assert out.num_scheduled_tokens == 4


def test_priority_admits_by_priority_then_arrival():
    sched = make_sched(max_num_seqs=1, policy="priority")
    runner = FakeRunner(sched)
    for rid, prio, arrival in (("p2", 2, 0.0), ("p0", 0, 1.0), ("p1a", 1, 2.0), ("p1b", 1, 3.0)):
        sched.add_request(make_req(rid, [1, 5], priority=prio, arrival=arrival, max_tokens=1))
    order = []
    for _ in range(4):
        out, _ = runner.step()
        order += [n.req_id for n in out.new_requests]
    assert order == ["p0", "p1a", "p1b", "p2"]


# ---- abort --------------------------------------------------------------------------------

def test_abort_frees_blocks_at_once_and_reports_in_next_output():
    sched = make_sched()
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", list(range(9))))
    sched.add_request(make_req("b", list(range(9))))
    runner.step()
    free_before = sched.block_manager.num_free_blocks
    done = sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a"]
    assert done[0].status.finish_reason == "abort"
    assert sched.block_manager.block_ids("a") == []
    assert sched.block_manager.num_free_blocks == free_before + 3
    out, _ = runner.step()
    assert out.finished_req_ids == {"a"}
    assert set(scheduled(out)) == {"b"}
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []  # already gone


def test_abort_while_step_runs_is_ignored_by_update():
    sched = make_sched()
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", list(range(5))))
    out = sched.schedule()
    result = runner.execute(out)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update(out, result) == []
    assert num_referenced(sched) == 0
    assert sched.schedule().finished_req_ids == {"a"}


def test_abort_waiting_request():
    sched = make_sched(max_num_seqs=1)
    runner = FakeRunner(sched)
    sched.add_request(make_req("a", [1, 2]))
    sched.add_request(make_req("b", [1, 2]))
    runner.step()
    done = sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["b"] and done[0].status.finish_reason == "abort"
    assert sched.num_waiting == 0 and set(sched.requests) == {"a"}
    # b never reached the runner, so it is not in finished_req_ids (FakeRunner rejects unknown ids)
    runner.run_until_done()
    assert "b" not in runner.state


# ---- prefix caching -----------------------------------------------------------------------

def test_prefix_cache_hit_starts_after_cached_full_blocks():
    sched = make_sched(caching=True)
    runner = FakeRunner(sched)
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks + 2
    sched.add_request(make_req("a", prompt))
    runner.step()
    a_blocks = sched.block_manager.block_ids("a")
    hits0 = sched.block_manager.prefix_hits
    sched.add_request(make_req("b", prompt))
    out, _ = runner.step()
    s = next(s for s in out.scheduled if s.req_id == "b")
    assert s.num_computed_tokens == 16 and s.token_ids == prompt[16:] and s.samples
    assert s.new_block_ids[:4] == a_blocks[:4]
    assert sched.requests["b"].num_cached_tokens == 16
    assert sched.block_manager.prefix_hits == hits0 + 16
    assert [sched.block_manager.blocks[i].ref_cnt for i in a_blocks[:4]] == [2, 2, 2, 2]


def test_prefix_cache_hit_after_first_request_finished():
    sched = make_sched(caching=True)
    runner = FakeRunner(sched)
    prompt = list(range(100, 109))  # 2 full blocks + 1
    sched.add_request(make_req("a", prompt, max_tokens=1))
    runner.run_until_done()
    sched.add_request(make_req("b", prompt + [1, 2, 3]))
    out, _ = runner.step()
    assert out.scheduled[0].num_computed_tokens == 8
    assert sched.requests["b"].num_cached_tokens == 8


def test_no_prefix_hit_when_caching_disabled():
    sched = make_sched(caching=False)
    runner = FakeRunner(sched)
    prompt = list(range(100, 118))
    sched.add_request(make_req("a", prompt))
    runner.step()
    sched.add_request(make_req("b", prompt))
    out, _ = runner.step()
    s = next(s for s in out.scheduled if s.req_id == "b")
    assert s.num_computed_tokens == 0 and sched.requests["b"].num_cached_tokens == 0


# ---- n > 1 siblings -----------------------------------------------------------------------

@pytest.mark.parametrize("caching", [True, False])
def test_siblings_wait_for_first_sample_then_share_its_prompt_blocks(caching):
    sched = make_sched(caching=caching, budget=8)
    runner = FakeRunner(sched, {"p#0": [11, 12, 13], "p#1": [14, 15, 16], "p#2": [17, 18, 19]})
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks + 1; needs 2 chunks of 8
    group = PromptGroup(3)
    for i in range(3):
        sched.add_request(make_req(f"p#{i}", prompt, max_tokens=3, group=group, sample_index=i))
    out, _ = runner.step()
    assert [s.req_id for s in out.scheduled] == ["p#0"] and not group.prompt_computed
    assert sched.num_waiting == 2
    # p#0's last chunk completes the prompt, so the siblings join in the same step, sharing its
    # full blocks (registered as they are scheduled: every layer stores K/V before attending)
    out, _ = runner.step()
    assert [s.req_id for s in out.scheduled] == ["p#0", "p#1", "p#2"] and out.scheduled[0].samples
    assert group.prompt_computed
    leader_blocks = sched.block_manager.block_ids("p#0")
    for s in out.scheduled[1:]:
        assert s.num_computed_tokens == 12 and s.token_ids == prompt[12:]
        assert s.new_block_ids[:3] == leader_blocks[:3]
    assert [sched.block_manager.blocks[i].ref_cnt for i in leader_blocks[:3]] == [3, 3, 3]
    runner.run_until_done()
    assert num_referenced(sched) == 0


def test_siblings_do_not_wait_for_an_aborted_leader():
    sched = make_sched()
    runner = FakeRunner(sched)
    group = PromptGroup(2)
    sched.add_request(make_req("p#0", list(range(20)), group=group))
    sched.add_request(make_req("p#1", list(range(20)), group=group, sample_index=1))
    sched.finish_requests(["p#0"], RequestStatus.FINISHED_ABORTED)
    out, _ = runner.step()
    assert [s.req_id for s in out.scheduled] == ["p#1"]
    assert out.scheduled[0].num_computed_tokens == 0


def test_waiting_sibling_keeps_its_fcfs_place():
    """A sibling waiting for its leader's prompt must not lose its place in the queue to
    requests that arrived after it."""
    sched = make_sched(budget=8, max_num_seqs=2)
    runner = FakeRunner(sched)
    g = PromptGroup(2)
    sched.add_request(make_req("q#0", list(range(12)), group=g, max_tokens=4))
    sched.add_request(make_req("q#1", list(range(12)), group=g, sample_index=1, max_tokens=4))
    sched.add_request(make_req("x", [1, 2, 3], max_tokens=4))
    sched.add_request(make_req("y", [4, 5, 6], max_tokens=4))
    admitted = []
    for _ in range(30):
        out, _ = runner.step()
        admitted += [n.req_id for n in out.new_requests]
        if not sched.has_unfinished_requests():
            break
    # step 2: q#0's last chunk completes the prompt and q#1 joins at once, ahead of x and y
    assert admitted == ["q#0", "q#1", "x", "y"]


# ---- random workloads ---------------------------------------------------------------------

@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(3, 10))
    cap = num_blocks * bs  # every request fits alone (as the input processor guarantees)
    reqs = []
    for i in range(draw(st.integers(1, 6))):
        plen = draw(st.integers(1, max(1, min(16, cap - 2))))
        max_tokens = draw(st.integers(1, max(1, min(10, cap - plen))))
        prompt = draw(st.lists(st.integers(3, 4), min_size=plen, max_size=plen))
        n = draw(st.sampled_from([1, 1, 2]))
        prio = draw(st.integers(0, 2))
        script = {}
        for k in range(n):
            script[k] = draw(st.lists(st.sampled_from([3, 4] * 3 + [EOS]), min_size=max_tokens, max_size=max_tokens))
        min_tokens = draw(st.integers(0, max_tokens))
        abort_at = draw(st.one_of(st.none(), st.integers(0, 12)))  # step after which it is aborted
        reqs.append((prompt, max_tokens, min_tokens, n, prio, script, abort_at))
    return dict(bs=bs, num_blocks=num_blocks, budget=draw(st.integers(1, 20)),
                max_num_seqs=draw(st.integers(1, 4)), policy=draw(st.sampled_from(["fcfs", "priority"])),
                caching=draw(st.booleans()), prefill_cap=draw(st.sampled_from([None, 1, 3])), reqs=reqs)


def _expected_output(script: list[int], min_tokens: int) -> list[int]:
    for k, t in enumerate(script):
        if t == EOS and k + 1 >= min_tokens:
            return script[:k + 1]
    return script


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_with_scripted_outputs(w):
    _run_random_workload(w)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 4), st.integers(0, 2 ** 32 - 1), st.sampled_from([0, 1, 3]))
def test_random_workloads_with_drafts_finish_with_scripted_outputs(w, k, seed, lookahead):
    """The same with speculative decoding: each sampling step proposes up to k drafts, some right
    (the script's next tokens), some wrong; the outputs must be exactly the scripted ones (never
    past max_tokens, stops mid-draft honoured), no draft ever lands in a cached block, and
    lookahead slots leak nothing."""
    import random
    rng = random.Random(seed)

    def propose(rid, next_k):
        return [runner_ref[0].token_for(rid, next_k + j + 1) if rng.random() < 0.7 else rng.choice([3, 4, 5, EOS])
                for j in range(rng.randint(0, k))]
    runner_ref = []
    _run_random_workload(w, propose, runner_ref, lookahead)


def _run_random_workload(w, propose=None, runner_ref=None, lookahead: int = 0):
    """Whatever chunking, preemption, prefix sharing, sibling waiting and aborts happen, every
    request finishes with exactly its scripted tokens (a prefix of them if aborted), limits hold
    every step, no block leaks and the runner is told to drop every request it saw."""
    sched = make_sched(num_blocks=w["num_blocks"], block_size=w["bs"], budget=w["budget"],
                       max_num_seqs=w["max_num_seqs"], policy=w["policy"], caching=w["caching"], max_model_len=10**6,
                       prefill_cap=w["prefill_cap"], lookahead=lookahead)
    script, expected, reqs, aborts = {}, {}, [], {}
    for i, (prompt, max_tokens, min_tokens, n, prio, sc, abort_at) in enumerate(w["reqs"]):
        group = PromptGroup(n) if n > 1 else None
        for k in range(n):
            rid = f"r{i}#{k}"
            script[rid] = sc[k]
            expected[rid] = _expected_output(sc[k], min_tokens)
            req = make_req(rid, prompt, max_tokens=max_tokens, min_tokens=min_tokens, priority=prio,
                           arrival=float(i), group=group, sample_index=k)
            reqs.append(req)
            sched.add_request(req)
            if abort_at is not None:
                aborts.setdefault(abort_at, []).append(rid)
    runner = FakeRunner(sched, script, propose)
    if runner_ref is not None:
        runner_ref.append(runner)
    bm = sched.block_manager
    for step in range(2000):
        if not sched.has_unfinished_requests():
            break
        if step in aborts:
            sched.finish_requests(aborts[step], RequestStatus.FINISHED_ABORTED)
        runner.step()
        assert sched.num_running <= w["max_num_seqs"]
        assert bm.num_free_blocks + num_referenced(sched) == bm.num_blocks
        for r in sched.running:
            if propose is None:
                assert len(bm.block_ids(r.request_id)) == bm.blocks_needed(r.num_computed_tokens)
            else:  # rejected drafts and lookahead slots keep their blocks until the request ends
                assert len(bm.block_ids(r.request_id)) >= bm.blocks_needed(r.num_computed_tokens)
            assert r.num_output_tokens <= r.max_tokens
    else:
        raise AssertionError("workload did not finish (livelock?)")
    for req in reqs:
        assert req.is_finished
        if req.status == RequestStatus.FINISHED_ABORTED:
            assert expected[req.request_id][:req.num_output_tokens] == req.output_token_ids
        else:
            assert req.output_token_ids == expected[req.request_id], req.request_id
    assert num_referenced(sched) == 0 and bm.req_blocks == {}
    runner.execute(sched.schedule())  # the last finished ids reach the runner
    assert runner.state == {}, "the runner was never told to drop these"
