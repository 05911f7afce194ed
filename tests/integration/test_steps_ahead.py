"""Two steps in flight (engine/llm_engine.steps_ahead): the engine core schedules and sends step
N + 2 before it takes in step N. The mp executor does so by default with async scheduling; in
process MINIVLLM_STEPS_AHEAD=2 does the same through the same engine code, which is what these
tests use (no worker processes to start); tests/integration/test_parallel_mp.py runs it at tp=2.

Each run must give what one step in flight gives: the same greedy tokens and finish reasons with
early stops, length limits, a preempting KV cache and a 16-token budget (prompts chunked beside
decoding requests);
the same seeded samples; requests with penalties (which need the tokens before them on the host)
mixed in; aborts; stop strings (the output processing ends those requests). And the runner must
fill a placeholder from an older step than the last one when the request skipped the last one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.runner.model_runner import ModelRunner

PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 40)), [100, 200, 300], [7] * 20, list(range(300, 250, -2)), [42],
           list(range(60, 90)), [11, 12]]


def _llm(path: str, monkeypatch, ahead: int, **kw) -> LLM:
    monkeypatch.setenv("MINIVLLM_STEPS_AHEAD", str(ahead))
    kw = {"num_kv_blocks": 4, "max_num_batched_tokens": 16, "enable_chunked_prefill": True, **kw}
    return LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, async_scheduling=True, **kw)


def _run(llm: LLM, params: list[SamplingParams]) -> list[tuple[list[int], str]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def _greedy_params(stops: list[int | None]) -> list[SamplingParams]:
    """Lengths from 3 to 38 tokens; a stop token for every other request (an early finish)."""
    return [SamplingParams(temperature=0, max_tokens=3 + 5 * i, ignore_eos=True,
                           stop_token_ids=[stops[i]] if stops[i] is not None and i % 2 == 0 else None)
            for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def stop_tokens(tiny_llama):
    """For each request, a token its greedy output has at position 2 (so a stop there ends it early)."""
    llm = LLM(model=tiny_llama(), dtype="float32", device="cpu", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids[2] for o in outs]


def test_greedy_tokens_and_finish_reasons_equal_one_step_in_flight(tiny_llama, stop_tokens, monkeypatch):
    params = _greedy_params(stop_tokens)
    one = _llm(tiny_llama(), monkeypatch, 1)
    reference = _run(one, params)
    assert one.llm_engine.num_steps_ahead == 0
    two = _llm(tiny_llama(), monkeypatch, 2)
    assert _run(two, params) == reference
    engine = two.llm_engine
    assert engine.num_steps_ahead > 10
    assert engine.get_stats().num_preemptions > 0  # 4 blocks of 16 tokens do not hold the batch
    assert {reason for _, reason in reference} == {"stop", "length"}
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks  # every block back


def test_a_placeholder_from_an_older_step():
    """A request that sampled in step N, not in N + 1, and decodes in N + 2 reads N's token (each
    request's latest sampled token is kept, not only the last step's); placeholders of one step
    may come from two steps."""
    runner = SimpleNamespace(_to_device=lambda values: torch.tensor(values, dtype=torch.int64))
    step_n, step_n1 = torch.tensor([11, 12, 13]), torch.tensor([21, 22])
    runner._sampled_at = {"a": (step_n, 0), "b": (step_n, 1), "c": (step_n, 2)}
    runner._sampled_at.update({"a": (step_n1, 0), "c": (step_n1, 1)})  # N + 1 sampled a and c, not b
    inputs = SimpleNamespace(input_ids=torch.full((6,), -1), placeholder_positions=[1, 3, 4],
                             placeholder_req_ids=["c", "b", "a"])
    ModelRunner._fill_placeholders(runner, inputs)
    assert inputs.input_ids.tolist() == [-1, 22, -1, 12, 21, -1]


def test_seeded_samples_and_penalties_equal_one_step_in_flight(tiny_llama, monkeypatch):
    """Seeded sampling (the runner's per-request generator counts pending tokens) and, for some
    requests, a repetition penalty: a step with one of those waits for every step before it."""
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12 + 3 * i, ignore_eos=True,
                             repetition_penalty=1.3 if i in (2, 5) else 1.0)
              for i in range(len(PROMPTS))]
    reference = _run(_llm(tiny_llama(), monkeypatch, 1, num_kv_blocks=64), params)
    two = _llm(tiny_llama(), monkeypatch, 2, num_kv_blocks=64)
    assert _run(two, params) == reference
    assert two.llm_engine.num_steps_ahead > 0  # once the penalised requests are done

    plain = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=16, ignore_eos=True) for i in range(len(PROMPTS))]
    assert _run(two, plain) == _run(_llm(tiny_llama(), monkeypatch, 1, num_kv_blocks=64), plain)


def test_an_abort_with_two_steps_in_flight(tiny_llama, monkeypatch):
    """A request aborted while two steps that hold it are in flight ends with "abort"; the others
    are untouched, and no step's late result reaches the aborted one."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reference = _run(_llm(tiny_llama(), monkeypatch, 1, num_kv_blocks=64), [params] * len(PROMPTS))
    engine = _llm(tiny_llama(), monkeypatch, 2, num_kv_blocks=64).llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    finals = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
        steps += 1
        if steps == 12:
            assert len(engine._older) == 1 and engine._inflight is not None  # two in flight
            engine.abort_request("3")
    assert finals["3"].finish_reason == "abort"
    for i, (tokens, reason) in enumerate(reference):
        if i != 3:
            assert (list(finals[str(i)].token_ids), finals[str(i)].finish_reason) == (tokens, reason)
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks


def test_stop_strings_with_two_steps_in_flight(monkeypatch):
    """Stop strings end a request in the output processing, after the scheduler took the step in:
    with two steps in flight the request is in the next two steps already. Text, tokens and
    finish reasons equal one step in flight's (the bundled model, its tokenizer)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at",
               "My favourite colour is", "1, 2, 3, 4,"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def results(llm: LLM, params) -> list:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]

    monkeypatch.setenv("MINIVLLM_STEPS_AHEAD", "1")
    one_llm = LLM(dtype="float32", device="cpu", async_scheduling=True)
    # a stop string from the middle of each request's own text (its characters 8 to 10)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[8:11]])
              for text, _, _ in results(one_llm, greedy)]
    one = results(one_llm, params)
    one_llm.llm_engine.shutdown()
    monkeypatch.setenv("MINIVLLM_STEPS_AHEAD", "2")
    two_llm = LLM(dtype="float32", device="cpu", async_scheduling=True)
    try:
        assert results(two_llm, params) == one
        assert two_llm.llm_engine.num_steps_ahead > 0
    finally:
        two_llm.llm_engine.shutdown()
    assert sum(reason == "stop" for _, _, reason in one) >= len(prompts) - 1


@pytest.mark.parametrize("backend, asynchronous, pp, spans, spec, env, want", [
    ("mp", True, 1, False, None, None, 2),       # ranks in worker processes: run ahead
    ("uni", True, 1, False, None, None, 1),      # in process: nothing to gain
    ("ray", True, 1, False, None, None, 1),
    ("mp", False, 1, False, None, None, 1),      # no async scheduling
    ("mp", True, 2, False, None, None, 1),       # pipeline stages keep their own batches in flight
    ("mp", True, 1, True, None, None, 1),        # replicas in lock-step (expert parallelism across them)
    ("mp", True, 1, False, object(), None, 1),   # speculative decoding
    ("mp", True, 1, False, None, "1", 1),        # switched off
    ("uni", True, 1, False, None, "2", 2),       # switched on in process
])
def test_which_engines_run_ahead(monkeypatch, backend, asynchronous, pp, spans, spec, env, want):
    from minivllm.engine.llm_engine import steps_ahead
    if env is None:
        monkeypatch.delenv("MINIVLLM_STEPS_AHEAD", raising=False)
    else:
        monkeypatch.setenv("MINIVLLM_STEPS_AHEAD", env)
    parallel = SimpleNamespace(distributed_executor_backend=backend, pipeline_parallel_size=pp, spans_replicas=spans)
    config = SimpleNamespace(async_scheduling=asynchronous, parallel=parallel, speculative=spec)
    assert steps_ahead(config) == want
