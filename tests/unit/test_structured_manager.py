"""The structured-output manager and grammar handles on the default model's real tokenizer and
xgrammar: compile cache, bitmasks (what they allow, vocabulary padding), accept / end / rollback,
the reasoning section, failed compiles; and the bitmask applied to logits (vectorised CPU path
against a plain loop)."""

from __future__ import annotations

import concurrent.futures
import random

import pytest
import torch

from minivllm.config import StructuredOutputsConfig
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured.bitmask import apply_token_bitmask_torch

pytest.importorskip("xgrammar")
from minivllm.structured.manager import StructuredOutputManager  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from minivllm.engine.config_builder import build_engine_config
    from minivllm.engine.tokenizer import load_tokenizer
    return load_tokenizer(build_engine_config(device="cpu").model)


def _manager(tok, vocab=None, reasoning=None) -> StructuredOutputManager:
    return StructuredOutputManager(StructuredOutputsConfig(reasoning_parser=reasoning), tok, vocab or len(tok),
                                   frozenset({tok.eos_token_id}), max_rows=4, pin_memory=False)


def _ready(handle):
    concurrent.futures.wait([handle._future], timeout=60)
    assert handle.is_ready(), handle.failure
    return handle


def _allowed(mgr, handle) -> set[int]:
    bm = mgr.bitmask([handle])
    assert bm is not None and bm.req_ids == [handle.request_id]
    bits = ((bm.bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    return set(torch.nonzero(bits).flatten().tolist())


def test_cache_shares_compiles(tokenizer):
    mgr = _manager(tokenizer)
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    h1, h2 = mgr.new_handle("r#0", so, [1]), mgr.new_handle("r#1", so, [1])
    h3 = mgr.new_handle("s", StructuredOutputsParams(json=so.json, disable_any_whitespace=True), [1])
    assert h1._future is h2._future and h3._future is not h1._future
    _ready(h1), _ready(h3)
    assert h1.matcher is not h2.matcher  # one matcher per sample
    mgr.shutdown()


def test_validation_is_remembered_for_a_repeated_spec(tokenizer, monkeypatch):
    """A spec that passed validation once is not checked again, by the engine's manager or the
    server's request check (one LRU: W7's JSON Schema meta-validation was ~4 ms a request); a
    different spec, or one that failed, is checked every time."""
    import uuid

    from minivllm.sampling_params import SamplingParams
    from minivllm.server.structured import Constraint, check_constraint
    from minivllm.structured import xgrammar_backend
    mgr = _manager(tokenizer)
    calls = []
    real = xgrammar_backend.XgrammarBackend.validate
    monkeypatch.setattr(xgrammar_backend.XgrammarBackend, "validate", staticmethod(lambda so: (calls.append(so), real(so))))
    name = "p" + uuid.uuid4().hex  # (the LRU lives for the process: a spec no other test has used)
    schema = {"type": "object", "properties": {name: {"type": "integer"}}}
    for _ in range(3):
        mgr.validate(SamplingParams(structured_outputs=StructuredOutputsParams(json=dict(schema))))
    check_constraint(Constraint("response_format", "response_format.json_schema.schema",
                                StructuredOutputsParams(json=dict(schema))), "xgrammar")
    assert len(calls) == 1
    mgr.validate(SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "string", "title": name})))
    assert len(calls) == 2
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", "minProperties": name}))
    for _ in range(2):
        with pytest.raises(ValueError, match="structured_outputs.json"):
            mgr.validate(bad)
    assert len(calls) == 4
    mgr.shutdown()


def test_choice_mask_accept_end_and_rollback(tokenizer):
    mgr = _manager(tokenizer)
    h = _ready(mgr.new_handle("r", StructuredOutputsParams(choice=["yes", "no"]), [1]))
    first = _allowed(mgr, h)
    texts = {tokenizer.decode([t]) for t in first}
    assert first and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    for t in tokenizer.encode("yes", add_special_tokens=False):
        assert h.accept_token(t)
    assert _allowed(mgr, h) == {tokenizer.eos_token_id} and not h.is_terminated()
    assert not h.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])  # refused, no change
    h.rollback(h.num_accepted)
    assert _allowed(mgr, h) == first and h.num_accepted == 0
    for t in tokenizer.encode("no", add_special_tokens=False) + [tokenizer.eos_token_id]:
        assert h.accept_token(t)
    assert h.is_terminated() and not h.needs_mask() and mgr.bitmask([h]) is None
    h.release()
    assert h.accept_token(5)  # a released grammar ignores late tokens
    mgr.shutdown()


def test_vocab_padding_is_never_allowed(tokenizer):
    n = len(tokenizer)
    mgr = _manager(tokenizer, vocab=n + 100)
    h = _ready(mgr.new_handle("r", StructuredOutputsParams(json_object=True), [1]))
    bm = mgr.bitmask([h])
    assert bm.bitmask.shape[1] * 32 >= n + 100
    allowed = _allowed(mgr, h)
    assert allowed and max(allowed) < n
    mgr.shutdown()


def test_constraint_starts_after_the_reasoning_section(tokenizer):
    mgr = _manager(tokenizer, reasoning="qwen3")
    h = _ready(mgr.new_handle("r", StructuredOutputsParams(choice=["yes"]), tokenizer.encode("Question?")))
    assert not h.needs_mask() and mgr.bitmask([h]) is None
    thought = tokenizer.encode("<think>I am sure.</think>", add_special_tokens=False)
    for t in thought[:-1]:
        assert h.accept_token(t) and not h.needs_mask()  # free text: not fed to the matcher
    assert h.accept_token(thought[-1]) and h.needs_mask() and h.num_accepted == 0
    assert {tokenizer.decode([t]) for t in _allowed(mgr, h)} <= {"y", "ye", "yes"}
    h.rollback(1)  # back into the reasoning section
    assert not h.needs_mask()
    closed = tokenizer.encode("<think>ok</think>", add_special_tokens=False)
    assert _ready(mgr.new_handle("s", StructuredOutputsParams(choice=["yes"]), [1] + closed)).needs_mask()
    mgr.shutdown()


def test_failed_compile_is_reported_and_not_cached(tokenizer, monkeypatch):
    mgr = _manager(tokenizer)
    backend = mgr._get_backend()
    real = backend.compile

    def compile_or_fail(key):
        if key.spec == "boom":
            raise RuntimeError("injected compile failure")
        return real(key)
    monkeypatch.setattr(backend, "compile", compile_or_fail)
    bad = mgr.new_handle("bad", StructuredOutputsParams(regex="boom"), [1])
    good = _ready(mgr.new_handle("good", StructuredOutputsParams(regex="a+"), [1]))
    concurrent.futures.wait([bad._future], timeout=60)
    mgr.wait_for_compiles(0.01)
    assert not bad.is_ready() and isinstance(bad.failure, RuntimeError) and good.is_ready()
    failed = mgr.take_failed()
    assert [rid for rid, _ in failed] == ["bad"] and mgr.take_failed() == []
    assert mgr.new_handle("again", StructuredOutputsParams(regex="boom"), [1])._future is not bad._future
    mgr.shutdown()


def test_batch_bitmask_rows_follow_the_handles(tokenizer):
    mgr = _manager(tokenizer)
    hs = [_ready(mgr.new_handle(f"r{i}", StructuredOutputsParams(choice=[w]), [1]))
          for i, w in enumerate(["apple", "zebra", "apple"])]
    hs[1].release()  # finished meanwhile: no row
    bm = mgr.bitmask(hs)
    assert bm.req_ids == ["r0", "r2"] and torch.equal(bm.bitmask[0], bm.bitmask[1])
    mgr.shutdown()


def test_threaded_and_serial_fills_give_the_same_rows(tokenizer):
    """A batch big enough for the measured choice between xgrammar's threads and one thread: every
    step, whichever way was picked, the rows equal a serial fill of the same matchers."""
    from minivllm.structured.xgrammar_backend import PARALLEL_FILL_MIN_ROWS
    mgr = _manager(tokenizer)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}
    hs = [_ready(mgr.new_handle(f"r{i}", StructuredOutputsParams(json=schema), [1]))
          for i in range(PARALLEL_FILL_MIN_ROWS + 4)]
    backend = mgr._get_backend()
    rng = random.Random(0)
    for _ in range(8):
        bm = mgr.bitmask(hs)
        serial = torch.zeros_like(bm.bitmask)
        backend._fill_serial([h.matcher for h in hs], serial)
        assert torch.equal(bm.bitmask, serial)
        for row, h in enumerate(hs):  # advance each matcher by one allowed token (not the end)
            bits = ((bm.bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
            allowed = [t for t in torch.nonzero(bits).flatten().tolist() if t != tokenizer.eos_token_id]
            if allowed:  # (an object already closed allows only the end)
                assert h.accept_token(rng.choice(allowed))
    assert all(n >= 3 for n in backend._fill_choice.tries.values())  # both ways were measured
    mgr.shutdown()


def test_fastest_of_probes_both_then_keeps_the_cheaper_and_reprobes():
    from minivllm.structured.backend import FastestOf
    choice = FastestOf(("a", "b"))
    cost = {"a": 2.0, "b": 1.0}
    seen = []
    for _ in range(2 * FastestOf.REPROBE_EVERY):
        way = choice.pick()
        seen.append(way)
        choice.record(way, cost[way])
    assert seen[:6] == ["a"] * 3 + ["b"] * 3  # probes first
    assert seen[6:].count("a") == 2  # then the cheaper, with one reprobe per REPROBE_EVERY picks
    cost["a"] = 0.1  # the other way got cheaper: seen at the next reprobes, then kept
    for _ in range(3 * FastestOf.REPROBE_EVERY):
        way = choice.pick()
        choice.record(way, cost[way])
    assert choice.pick() == "a"


@pytest.mark.parametrize("vocab,rows,batch", [(100, 3, 5), (64, 1, 1), (1000, 7, 7), (33, 2, 4)])
def test_apply_bitmask_matches_a_loop(vocab, rows, batch):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(batch, vocab, generator=g)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    row_ids = torch.tensor(random.Random(vocab).sample(range(batch), rows), dtype=torch.int64)
    want = logits.clone()
    for i, r in enumerate(row_ids.tolist()):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    got = logits.clone()
    apply_token_bitmask_torch(got, bitmask, row_ids)
    assert torch.equal(got, want)
