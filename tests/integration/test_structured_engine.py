"""Structured outputs through the engine on the default model (CPU): realistic JSON schemas
sampled at temperature 0.8 validate with `jsonschema`; regex, choice and grammar outputs match;
a constrained and an unconstrained request in one batch (the unconstrained one's tokens equal
those it gets alone); n > 1; masks applied before logprobs; stop strings; the reasoning
section left free; preemption under a tiny KV cache and async scheduling; a grammar that fails
to compile at run time ends only its own request."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import jsonschema
import pytest

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.engine.tokenizer import apply_chat_template

pytest.importorskip("xgrammar")

SCHEMAS = Path(__file__).resolve().parents[2] / "minivllm" / "bench" / "schemas"
SEEDS = (0, 1)


def load_schemas() -> dict[str, tuple[str, dict]]:
    """name -> (prompt, schema); config_tree without its uniqueItems, which no grammar enforces
    (the original is refused: tests/unit/test_structured_params.py)."""
    out = {}
    for path in sorted(SCHEMAS.glob("*.json")):
        d = json.loads(path.read_text())
        if path.stem == "config_tree":
            d["schema"]["properties"]["tags"].pop("uniqueItems")
        out[path.stem] = (d["prompt"], d["schema"])
    return out


def _chat(llm, text: str) -> dict:
    return {"prompt_token_ids": apply_chat_template(llm.get_tokenizer(), [{"role": "user", "content": text}])}


def _json(schema: dict, seed: int, max_tokens: int = 128, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=schema), **kw)


def test_schemas_validate(llm):
    schemas = load_schemas()
    cases = [(name, seed) for name in schemas for seed in SEEDS]
    outs = llm.generate([_chat(llm, schemas[n][0]) for n, _ in cases], [_json(schemas[n][1], s) for n, s in cases],
                        use_tqdm=False)
    stopped = 0
    for (name, seed), out in zip(cases, outs):
        o = out.outputs[0]
        if o.finish_reason == "stop":  # the grammar ended; "length" is cut short by max_tokens
            stopped += 1
            jsonschema.validate(json.loads(o.text), schemas[name][1])
        else:
            assert o.finish_reason == "length", (name, seed, o.finish_reason)
    assert stopped >= 0.6 * len(cases), f"only {stopped} of {len(cases)} finished"


def test_regex_choice_and_whitespace(llm):
    regexes = [r"\d{3}-\d{4}", r"(cat|dog)s? [a-z]{2,6}!", r"[A-Z][a-z]{1,8}@[a-z]{1,8}\.(com|org)"]
    choices = ["red", "green", "blue", "dark purple"]
    schema = load_schemas()["weather_call"][1]
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(regex=r)) for r in regexes for s in SEEDS]
    params += [SamplingParams(temperature=0.8, seed=s, max_tokens=8,
                              structured_outputs=StructuredOutputsParams(choice=choices)) for s in SEEDS]
    tight = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params += [SamplingParams(temperature=0, max_tokens=64, structured_outputs=tight)]
    prompts = ["Write something:"] * (len(params) - 1) + [_chat(llm, load_schemas()["weather_call"][0])]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, r in enumerate(regexes):
        for o in outs[2 * i: 2 * i + 2]:
            assert o.finish_reason == "stop" and re.fullmatch(r, o.text), (r, o.text)
    for o in outs[6:8]:
        assert o.text in choices and o.finish_reason == "stop"
    o = outs[8]
    assert o.finish_reason == "stop"
    jsonschema.validate(json.loads(o.text), schema)
    assert o.text == json.dumps(json.loads(o.text)), o.text  # no free whitespace: one space after "," and ":"


ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= [1-9] [0-9]{0,2} | "(" expr ")"
"""
ARITH_LARK = """
?start: expr
expr: term (("+" | "-") term) ~ 0..3
term: factor (("*" | "/") factor) ~ 0..2
factor: NONZERO DIGIT ~ 0..2 | "(" expr ")"
NONZERO: "1".."9"
DIGIT: "0".."9"
"""


@pytest.mark.parametrize("grammar", [ARITH_EBNF, ARITH_LARK], ids=["ebnf", "lark"])
def test_arithmetic_grammar_parses(llm, grammar):
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(grammar=grammar)) for s in (0, 1, 2)]
    for out in llm.generate(["Compute: "] * 3, params, use_tqdm=False):
        o = out.outputs[0]
        if o.finish_reason != "stop":
            continue
        tree = ast.parse(o.text, mode="eval")  # Python's own parser: a valid arithmetic expression
        assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.operator)) for n in ast.walk(tree))


def test_constrained_rows_do_not_leak_into_others(llm):
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, [free, seeded], use_tqdm=False)]
    so = StructuredOutputsParams(choice=["zzz", "qqq"])
    mixed = llm.generate(prompts + ["Pick:", "The capital of France is"],
                         [free, seeded, SamplingParams(temperature=0, max_tokens=5, structured_outputs=so),
                          SamplingParams(temperature=0.8, seed=1, max_tokens=40,
                                         structured_outputs=StructuredOutputsParams(json_object=True))],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert mixed[2].outputs[0].text in ("zzz", "qqq")


def test_n_samples_each_follow_the_grammar(llm):
    schema = load_schemas()["sentiment"][1]
    p = _json(schema, 3, 64, n=3)
    out = llm.generate([_chat(llm, "Classify 'great film' as JSON.")], p, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for o in out.outputs:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), schema)
    assert len({o.text for o in out.outputs}) > 1  # separate samples, separate matchers


def test_mask_comes_before_logprobs(llm):
    tok = llm.get_tokenizer()
    p = SamplingParams(temperature=0, max_tokens=4, logprobs=5,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    o = llm.generate(["Is the sky blue? Answer:"], p, use_tqdm=False)[0].outputs[0]
    assert o.text in ("yes", "no")
    first = o.logprobs[0]
    finite = [t for t, lp in first.items() if lp.logprob > float("-inf")]
    assert finite and all("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])) for t in finite)
    assert abs(sum(2.718281828 ** first[t].logprob for t in finite) - 1.0) < 0.05 or len(finite) < len(first)


def test_stop_string_inside_constrained_output(llm):
    p = SamplingParams(temperature=0.0, max_tokens=30, stop=[" STOP"],
                       structured_outputs=StructuredOutputsParams(regex=r"[a-z]{1,8} STOP [a-z]{1,8}"))
    o = llm.generate(["Words:"], p, use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and re.fullmatch(r"[a-z]{1,8}", o.text), o.text


def test_constraint_starts_after_reasoning(llm, monkeypatch):
    """A stand-in reasoning parser whose section ends at " is": the model writes freely up to
    it, then only the regex."""
    from minivllm.reasoning.base import ReasoningParser

    class UntilIs(ReasoningParser):
        start, end, implicit_start = "<<never>>", " is", True

    mgr = llm.llm_engine.structured
    parser = UntilIs()
    monkeypatch.setattr(mgr, "_reasoner", parser)
    monkeypatch.setattr(mgr, "_start_marker", parser.marker_ids(llm.get_tokenizer())[0])
    monkeypatch.setattr(mgr, "_end_marker", parser.marker_ids(llm.get_tokenizer())[1])
    p = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r" (Lyon|Nice)\."))
    o = llm.generate(["The capital of France"], p, use_tqdm=False)[0].outputs[0]
    head, sep, tail = o.text.partition(" is")
    assert sep and re.fullmatch(r" (Lyon|Nice)\.", tail), o.text  # unconstrained it says " is Paris."


def test_compile_failure_at_run_time_ends_only_its_request(llm, monkeypatch):
    backend = llm.llm_engine.structured._get_backend()
    real = backend.compile

    def compile_or_fail(key):
        if key.spec == "z{1,3}":
            raise RuntimeError("injected compile failure")
        return real(key)
    monkeypatch.setattr(backend, "compile", compile_or_fail)
    outs = llm.generate(["a", "b", "c"], [SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="z{1,3}")),
                                          SamplingParams(temperature=0, max_tokens=5),
                                          SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="y{1,3}"))],
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].finish_reason == "length" and re.fullmatch("y{1,3}", outs[2].outputs[0].text)


def test_bad_constraint_is_refused_and_the_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex does not compile: .*position"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a")), use_tqdm=False)
    o = llm.generate(["x"], SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="ab")),
                     use_tqdm=False)[0].outputs[0]
    assert o.text == "ab"


@pytest.fixture(scope="module")
def tiny_kv_llm():
    """A KV cache of 16 blocks x 16 tokens and async scheduling (the GPU's step loop, on the CPU)."""
    return LLM(dtype="float32", device="cpu", num_kv_blocks=16, max_num_seqs=8, async_scheduling=True)


def test_async_scheduling_gives_the_same_outputs(llm, tiny_kv_llm, monkeypatch):
    """With a step in flight, a constrained step's bitmask is filled on the manager's fill thread
    (beside the detokenization of the step before), and the outputs equal the synchronous
    engine's, where every fill runs on the engine thread."""
    import threading
    manager = tiny_kv_llm.llm_engine.structured
    threads = []
    fill = manager.bitmask

    def recording_bitmask(handles):
        threads.append(threading.current_thread().name)
        return fill(handles)
    monkeypatch.setattr(manager, "bitmask", recording_bitmask)
    schema = load_schemas()["person"][1]
    prompts = [_chat(llm, "Describe a fictional person as JSON.")] * 2
    params = [_json(schema, s, 48) for s in SEEDS]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tiny_kv_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    on_fill_thread = sum(name.startswith("minivllm-grammar-fill") for name in threads)
    assert on_fill_thread >= len(threads) // 2, threads  # all but the steps with nothing in flight


def test_next_step_is_queued_before_the_constrained_sampling(llm, tiny_kv_llm):
    """With async scheduling, a constrained step schedules and queues the step after it before
    its own sampling (LLMEngine._schedule_next / _pipeline_next: the device then never waits for
    the host between the two). A batch that mixes constrained, unconstrained and stop-string
    requests under a KV cache small enough to preempt gives the synchronous engine's tokens,
    and the pipelined path really ran."""
    schemas = load_schemas()
    names = ["person", "shape", "order"]
    longer = " " + "Be detailed. " * 24  # 16 blocks of 16 tokens hold about one and a half of these
    prompts = [_chat(llm, schemas[n][0] + longer) for n in names]
    prompts += [_chat(llm, "Count from one to twenty in words." + longer)] * 2
    params = [_json(schemas[n][1], 7 + i, 64) for i, n in enumerate(names)]
    params += [SamplingParams(temperature=0.8, seed=3, max_tokens=40),
               SamplingParams(temperature=0.0, max_tokens=40, stop=["ten"])]
    engine = tiny_kv_llm.llm_engine
    before, preempted = engine.num_pipelined_steps, engine.scheduler.num_preemptions
    early = engine.num_early_schedules
    want = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
           for o in tiny_kv_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert want[-1][2] == "stop" and "ten" not in want[-1][1], want[-1]  # the stop string cut it
    assert engine.num_pipelined_steps > before
    # steps whose rows have no stop string schedule the next one beside the fill and make their
    # outputs after queueing the sampling (LLMEngine._take_in); the others do not
    assert engine.num_early_schedules > early
    assert engine.scheduler.num_preemptions > preempted, "the test needs preemptions"
    assert not engine.has_unfinished_requests()


def test_fill_runs_with_a_short_gil_switch_interval(tiny_kv_llm, monkeypatch):
    """While a step's bitmask fill runs on the fill thread beside the detokenization, the engine
    shortens Python's GIL switch interval (each handoff between the two threads otherwise waits
    for the 5 ms default: scripts/bench_fill_overlap.py), and restores it afterwards."""
    import sys

    from minivllm.engine.llm_engine import FILL_SWITCH_INTERVAL_S
    manager = tiny_kv_llm.llm_engine.structured
    seen = []
    fill_async = manager.fill_async

    def recording(handles):
        seen.append(sys.getswitchinterval())
        return fill_async(handles)
    monkeypatch.setattr(manager, "fill_async", recording)
    before = sys.getswitchinterval()
    schema = load_schemas()["shape"][1]
    tiny_kv_llm.generate([_chat(tiny_kv_llm, "A shape as JSON.")] * 2, [_json(schema, s, 24) for s in SEEDS],
                         use_tqdm=False)
    assert seen and all(v == pytest.approx(FILL_SWITCH_INTERVAL_S) for v in seen)
    assert sys.getswitchinterval() == before


def test_preemption_mid_constraint_still_valid(tiny_kv_llm):
    schemas = load_schemas()
    names = ["order", "person", "shape", "event"]
    prompts = [_chat(tiny_kv_llm, schemas[n][0] + " " + "Be detailed. " * 12) for n in names]
    engine = tiny_kv_llm.llm_engine
    before = engine.scheduler.num_preemptions
    outs = tiny_kv_llm.generate(prompts, [_json(schemas[n][1], 5, 64) for n in names], use_tqdm=False)
    assert engine.scheduler.num_preemptions > before, "the test needs preemptions"
    for n, out in zip(names, outs):
        o = out.outputs[0]
        assert o.finish_reason in ("stop", "length")
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), schemas[n][1])
        else:  # cut short: still a prefix the grammar allowed, so no stray characters before it
            assert o.text.lstrip().startswith("{")


def test_speculative_engine_constrained_requests_take_no_drafts():
    """With speculative decoding (ngram), a constrained request samples its one row under its
    bitmask and is never given drafts; unconstrained requests beside it still speculate."""
    llm = LLM(dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_bytes=128 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    stats = llm.llm_engine.scheduler.spec_stats
    text = "Repeat exactly: " + "red green blue, " * 8
    regex = r"(red|green|blue)(, (red|green|blue)){2,6}"
    so = StructuredOutputsParams(regex=regex)
    outs = llm.generate([text, text], [SamplingParams(temperature=0, max_tokens=24, structured_outputs=so),
                                       SamplingParams(temperature=0.7, seed=1, max_tokens=24, structured_outputs=so)],
                        use_tqdm=False)
    assert stats.num_draft_tokens == 0
    for o in outs:
        assert re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text
    free = llm.generate([text], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert len(free[0].outputs[0].token_ids) == 24 and stats.num_draft_tokens > 0


def test_random_aborts_during_pipelined_constrained_steps(tiny_kv_llm):
    """Aborts at random steps while constrained steps schedule and queue the step after them
    (async scheduling, a 16-block cache that preempts): every request ends with a terminal
    output (aborted ones included), and every KV block is free again afterwards."""
    import random
    engine = tiny_kv_llm.llm_engine
    schemas = load_schemas()
    names = sorted(schemas)
    rng = random.Random(7)
    before = engine.num_pipelined_steps
    ids = []
    for i in range(8):
        name = names[i % len(names)]
        params = _json(schemas[name][1], i, 24) if i % 4 else SamplingParams(temperature=0.8, seed=i, max_tokens=24)
        rid = f"abort-{i}"
        engine.add_request(rid, _chat(tiny_kv_llm, schemas[name][0]), params)
        ids.append(rid)
    ended, steps = set(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ended.add(out.request_id)
        steps += 1
        if steps % 3 == 0:
            live = [r for r in ids if r not in ended]
            if live and rng.random() < 0.5:
                engine.abort_request(rng.choice(live))
        assert steps < 2000, "the engine did not drain"
    assert ended == set(ids)
    assert engine.num_pipelined_steps > before
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.requests


@pytest.fixture(scope="module")
def small_budget_llm():
    """Async scheduling with a 16-token step budget (every prompt is longer: chunked), a 24-block
    KV cache (preemption) and the prefix cache: the sharp configuration for the pipelined step."""
    return LLM(dtype="float32", device="cpu", num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=16,
               async_scheduling=True)


PIPELINE_EDGES = {  # rows of one batch: "c" constrained, "f" free; "c=" repeats the prompt before (a prefix hit)
    "no constrained row": "fff",
    "one constrained row": "c",
    "all rows constrained": "ccc",
    "free rows first": "ffcc",
    "prefix hit": "cc=",
}


@pytest.mark.parametrize("edge", list(PIPELINE_EDGES))
def test_pipelined_step_edges_equal_the_synchronous_engine(llm, small_budget_llm, edge):
    """Each edge of the pipelined constrained step (LLMEngine._schedule_next): no constrained row
    (the step is never taken), one, all, free rows before constrained ones, a prefix hit; under
    a step budget shorter than every prompt and a cache that preempts. Seeded tokens equal the
    synchronous engine's."""
    schemas = load_schemas()
    names = sorted(schemas)
    prompts, params = [], []
    for i, kind in enumerate(PIPELINE_EDGES[edge].replace("=", "")):
        name = names[i % len(names)]
        text = schemas[name][0] if kind == "c" else f"Write a short poem about the number {i}."
        prompts.append(_chat(llm, text + " Be brief."))
        params.append(_json(schemas[name][1], 11 + i, 20) if kind == "c"
                      else SamplingParams(temperature=0.8, seed=11 + i, max_tokens=20))
    if "=" in PIPELINE_EDGES[edge]:
        prompts[-1] = prompts[-2]
        params[-1] = _json(schemas[names[0]][1], 99, 20)
    engine = small_budget_llm.llm_engine
    before, hits = engine.num_pipelined_steps, engine.get_stats().prefix_cache_hits
    early = engine.num_early_schedules
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in small_budget_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    if "=" in PIPELINE_EDGES[edge]:
        assert engine.get_stats().prefix_cache_hits > hits, "the repeated prompt should hit the prefix cache"
    if "c" in PIPELINE_EDGES[edge]:
        assert engine.num_pipelined_steps > before
        assert engine.num_early_schedules > early  # (no stop strings here)
    else:
        assert engine.num_pipelined_steps == before
        assert engine.num_early_schedules == early
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_next_step_build_failing_beside_the_fill_ends_cleanly(tiny_kv_llm, monkeypatch):
    """The next step's input build raises while it runs beside the fill (LLMEngine._take_in's
    early path): the step before's tokens still reach their requests, the constrained step and
    the half-scheduled next one end with "error" rather than hang, the engine serves the next
    requests, and every KV block is free again."""
    engine = tiny_kv_llm.llm_engine
    runner = engine.executor.runner
    real, calls = runner.prepare_forward, []

    def failing_once(sched):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected input-build failure")
        return real(sched)
    monkeypatch.setattr(runner, "prepare_forward", failing_once)
    take_in, errors = engine._take_in, []

    def recording_take_in(*args, **kwargs):
        taken = take_in(*args, **kwargs)
        errors.append(taken.error)
        return taken
    monkeypatch.setattr(engine, "_take_in", recording_take_in)
    schemas = load_schemas()
    names = sorted(schemas)[:3]
    prompts = [_chat(tiny_kv_llm, schemas[n][0]) for n in names]
    params = [_json(schemas[n][1], 5 + i, 24) for i, n in enumerate(names)]
    early = engine.num_early_schedules
    outs = tiny_kv_llm.generate(prompts, params, use_tqdm=False)
    assert len(calls) >= 3 and engine.num_early_schedules > early
    assert [str(e) for e in errors if e is not None] == ["injected input-build failure"]  # raised beside the fill
    assert all(o.finished for o in outs)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert "error" in reasons, reasons
    for _ in range(8):  # (an async engine may still have the step that tells the runner about finished requests)
        if not engine.has_unfinished_requests():
            break
        assert not engine.step()
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    again = tiny_kv_llm.generate(prompts[:1], params[:1], use_tqdm=False)[0]
    assert again.outputs[0].finish_reason in ("stop", "length")
