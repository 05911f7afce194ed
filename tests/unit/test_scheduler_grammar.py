"""The scheduler's side of structured outputs, with a fake grammar (pure Python): a request
whose grammar compiles waits without holding back the others; every sampled token goes to its
grammar; a refused token ends the request with an error, an ended grammar with "stop"; the
grammar is released when the request ends (finish, abort) and kept across preemption."""

from __future__ import annotations

from dataclasses import dataclass, field

from test_scheduler import FakeRunner, make_req, make_sched, scheduled

from minivllm.core.request import RequestStatus


@dataclass
class FakeGrammar:
    ready: bool = True
    refuse: set[int] = field(default_factory=set)
    end_on: int | None = None  # the token that ends the grammar
    accepted: list[int] = field(default_factory=list)
    terminated: bool = False
    released: bool = False

    def is_ready(self) -> bool:
        return self.ready

    def accept_token(self, token_id: int) -> bool:
        assert not self.released
        if token_id in self.refuse:
            return False
        self.accepted.append(token_id)
        self.terminated = token_id == self.end_on
        return True

    def is_terminated(self) -> bool:
        return self.terminated

    def release(self) -> None:
        self.released = True


def _req(rid, grammar, **kw):
    r = make_req(rid, [1, 2, 3, 4, 5], **kw)
    r.grammar = grammar
    return r


def test_compiling_request_waits_without_blocking_others():
    sched = make_sched()
    runner = FakeRunner(sched)
    g = FakeGrammar(ready=False)
    sched.add_request(_req("slow", g, max_tokens=3))  # first in line
    sched.add_request(make_req("b", [9, 9, 9], max_tokens=3))
    out, _ = runner.step()
    assert list(scheduled(out)) == ["b"] and sched.requests["slow"].status == RequestStatus.WAITING
    runner.step()
    g.ready = True
    out, _ = runner.step()
    assert "slow" in scheduled(out)
    runner.run_until_done()
    assert g.accepted == [7, 7, 7] and g.released


def test_refused_token_fails_only_that_request():
    sched = make_sched()
    runner = FakeRunner(sched, {"bad": [7, 13, 7], "ok": [7, 13, 7]})
    g = FakeGrammar(refuse={13})
    sched.add_request(_req("bad", g, max_tokens=3))
    sched.add_request(make_req("ok", [5, 6], max_tokens=3))
    runner.step()
    _, updates = runner.step()
    bad = next(u for u in updates if u.request.request_id == "bad")
    assert bad.finished and bad.request.status == RequestStatus.FINISHED_ERROR and g.released
    assert g.accepted == [7]
    runner.run_until_done()
    assert "ok" not in sched.requests  # finished normally


def test_ended_grammar_stops_the_request():
    sched = make_sched()
    runner = FakeRunner(sched, {"a": [7, 8, 42, 7]})
    g = FakeGrammar(end_on=42)
    req = _req("a", g, max_tokens=10, ignore_eos=True)
    sched.add_request(req)
    runner.run_until_done()
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [7, 8, 42] and g.released


def test_abort_releases_and_preemption_keeps_the_grammar():
    sched = make_sched(num_blocks=4, block_size=4, budget=64)
    runner = FakeRunner(sched, {"a": [31, 32, 33, 34], "b": [41, 42, 43, 44, 45]})
    ga, gb = FakeGrammar(), FakeGrammar()
    sched.add_request(_req("a", ga, max_tokens=4))
    b = make_req("b", list(range(200, 207)), max_tokens=5)
    b.grammar = gb
    a = sched.requests["a"]
    a.prompt_token_ids[:] = list(range(100, 107))
    a.all_token_ids[:] = list(range(100, 107))
    sched.add_request(b)
    runner.step()
    runner.step()
    out, _ = runner.step()  # b is preempted to make room for a
    assert out.preempted_req_ids == {"b"} and not gb.released and gb.accepted == [41, 42]
    runner.run_until_done()
    assert gb.accepted == [41, 42, 43, 44, 45] and gb.released and ga.released
    g = FakeGrammar()
    sched.add_request(_req("c", g))
    runner.step()
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert g.released
