"""A model step that raises: its requests end with finish_reason "error", the engine keeps
serving, and the prefix cache does not keep blocks whose K/V that step never wrote (their
hashes were published when the step was scheduled). With async scheduling the step launched
after the failed one fails too, since it may read what the failed one never wrote."""

from __future__ import annotations

import random

import pytest

from minivllm.bench.model_dirs import write_model_dir
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def model_dir(tmp_path):
    return write_model_dir("tiny-llama", str(tmp_path))


def _engine(model_dir: str, **kw) -> LLMEngine:
    return LLMEngine.from_kwargs(model=model_dir, load_format="dummy", skip_tokenizer_init=True, device="cpu",
                                 dtype="float32", num_kv_blocks=256, max_model_len=512, seed=0, **kw)


def _run(eng: LLMEngine) -> dict[str, object]:
    finals = {}
    for _ in range(200):
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
        if not eng.has_unfinished_requests():
            return finals
    raise AssertionError("requests did not finish")


def _fail_launch(eng: LLMEngine, calls: set[int]):
    """Make the executor's n-th launch (0-based) raise, for n in calls."""
    real, count = eng.executor.launch, [0]

    def launch(sched):
        n = count[0]
        count[0] += 1
        if n in calls:
            raise RuntimeError("injected device failure")
        return real(sched)
    eng.executor.launch = launch


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_failed_step_leaves_no_poisoned_prefix(model_dir, async_scheduling):
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(70)]  # 4 full blocks of 16 + 6 tokens
    want = _run(_add(_engine(model_dir, async_scheduling=async_scheduling), "ref", prompt))["ref"].token_ids

    eng = _engine(model_dir, async_scheduling=async_scheduling)
    _fail_launch(eng, {0})  # the prefill of "a" fails after its blocks were registered
    finals = _run(_add(eng, "a", prompt))
    assert finals["a"].finish_reason == "error"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert not eng.block_manager.cached  # nothing findable that was never written
    hits_before = eng.block_manager.prefix_hits
    finals = _run(_add(eng, "b", prompt))  # the engine keeps serving, from a clean cache
    assert eng.block_manager.prefix_hits == hits_before
    assert finals["b"].finish_reason == "length" and finals["b"].token_ids == want


def test_async_failure_also_fails_the_step_in_flight(model_dir):
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(1000) for _ in range(40)] for i in range(3)}
    eng = _engine(model_dir, async_scheduling=True)
    for rid, p in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": p}, GREEDY)
    real_finish, count = eng.executor.finish, [0]

    def finish(launched):  # the first step's results never arrive; the second is in flight then
        count[0] += 1
        if count[0] == 1:
            raise RuntimeError("injected device failure")
        return real_finish(launched)
    eng.executor.finish = finish
    finals = _run(eng)
    assert sorted(finals) == sorted(prompts)  # every request gets a terminal output
    assert {o.finish_reason for o in finals.values()} == {"error"}
    assert not eng.block_manager.cached and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    # and the engine still serves
    finals = _run(_add(eng, "after", prompts["r0"]))
    assert finals["after"].finish_reason == "length" and len(finals["after"].token_ids) == GREEDY.max_tokens


def _add(eng: LLMEngine, rid: str, prompt: list[int]) -> LLMEngine:
    eng.add_request(rid, {"prompt_token_ids": prompt}, GREEDY)
    return eng


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_fault_of_one_request_fails_it_alone(model_dir, async_scheduling):
    """A step raising RequestFault for one request: that request ends with "error", the step's
    other requests are recomputed and finish with exactly the tokens they get without the fault;
    nothing leaks and no unwritten block stays findable."""
    from minivllm.core.interfaces import RequestFault
    rng = random.Random(2)
    prompts = {f"r{i}": [rng.randrange(1000) for _ in range(30 + 7 * i)] for i in range(4)}
    ref_engine = _engine(model_dir, async_scheduling=async_scheduling)
    for rid, p in prompts.items():
        _add(ref_engine, rid, p)
    want = {rid: o.token_ids for rid, o in _run(ref_engine).items()}

    eng = _engine(model_dir, async_scheduling=async_scheduling)
    for rid, p in prompts.items():
        _add(eng, rid, p)
    real, count = eng.executor.launch, [0]

    def launch(sched):  # the third step blames r2 (scheduled in it, mid-decode)
        count[0] += 1
        if count[0] == 3:
            assert "r2" in {s.req_id for s in sched.scheduled}
            raise RequestFault(["r2"], "injected: r2's grammar broke")
        return real(sched)
    eng.executor.launch = launch
    finals = _run(eng)
    assert finals["r2"].finish_reason == "error"
    for rid in ("r0", "r1", "r3"):
        assert finals[rid].finish_reason == "length" and finals[rid].token_ids == want[rid], rid
    assert eng.scheduler.num_preemptions >= 3  # the innocent ones were recomputed
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.step()
    assert eng.executor.runner.requests == {}
