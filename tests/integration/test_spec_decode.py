"""Speculative decoding on the default model, fp32 on the CPU: every proposer gives exactly the
non-speculative greedy tokens (batched, and with preemption forced by a tiny KV cache), accepts
for real where it should, leaks no block under aborts; bad configurations fail at startup."""

from __future__ import annotations

import os

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.config_builder import build_engine_config
from minivllm.engine.llm_engine import LLMEngine
from minivllm.models.source import default_gguf_path

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
           "polished the great lens and wrote the weather in a leather book. Ships passed far out at sea, "
           "and none of them ever knew his name.")
REPEAT = [f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
          f"Copy this sentence: {PASSAGE.split('. ')[0]}."]
CHAT = ["What is the capital of France?", "Write a haiku about autumn.", "List three prime numbers.",
        "Explain photosynthesis in one sentence."]
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6},
    "draft_model": {"model": None, "num_speculative_tokens": 3},  # the default model drafts for itself
    "layer_skip": {"method": "layer_skip", "num_layers": 12, "num_speculative_tokens": 3},
    "medusa": {"method": "medusa", "model": None, "num_speculative_tokens": 3},
}


def _chat(engine_or_llm, prompts, params=GREEDY):
    from minivllm.engine.tokenizer import apply_chat_template
    tok = engine_or_llm.get_tokenizer()
    return [{"prompt_token_ids": apply_chat_template(tok, [{"role": "user", "content": p}])} for p in prompts]


@pytest.fixture(scope="module")
def medusa_dir():
    """Heads trained for the default model by scripts/train_medusa.py on its own answers
    (tests/data/medusa-smollm2, float16; tests/unit/test_train_medusa.py runs the script itself)."""
    return os.path.join(os.path.dirname(__file__), "..", "data", "medusa-smollm2")


@pytest.fixture(scope="module")
def base():
    """The non-speculative reference; its loaded model is then shared by the speculative engines
    (which replace its KV cache: the base engine does not run again)."""
    llm = LLM(dtype="float32", device="cpu")
    prompts = _chat(llm, REPEAT + CHAT)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return llm.llm_engine.executor.runner.model, prompts, ref


def _spec_llm(model, cfg: dict, medusa_dir: str | None = None, **kw) -> LLM:
    cfg = dict(cfg)
    if "model" in cfg:
        cfg["model"] = medusa_dir if cfg.get("method") == "medusa" else default_gguf_path()
    config = build_engine_config(dtype="float32", device="cpu", speculative_config=cfg, **kw)
    llm = LLM.__new__(LLM)
    llm.llm_engine = LLMEngine(config, model=model)
    return llm


def _assert_no_leak(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.step()  # the runner hears of the last finished requests with the next step
    assert engine.executor.runner.requests == {}


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_tokens_equal_non_speculative(base, method, request):
    model, prompts, ref = base
    medusa = request.getfixturevalue("medusa_dir") if method == "medusa" else None
    llm = _spec_llm(model, METHODS[method], medusa)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert out == ref
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    if method in ("ngram", "draft_model"):
        assert stats.num_accepted_tokens > 0
    _assert_no_leak(llm)
    # one at a time, and under a KV cache that preempts constantly
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], GREEDY, use_tqdm=False)] == ref[:1]
    longest = max(len(p["prompt_token_ids"]) for p in prompts) + MAX_NEW
    tiny = _spec_llm(model, METHODS[method], medusa, num_kv_blocks=longest // 16 + 2, enable_prefix_caching=False)
    out = [o.outputs[0].token_ids for o in tiny.generate(prompts, GREEDY, use_tqdm=False)]
    assert tiny.llm_engine.scheduler.num_preemptions > 0
    assert out == ref
    _assert_no_leak(tiny)


def test_acceptance_is_real(base, medusa_dir):
    """n-gram accepts most proposals on prompts that ask to repeat given text; a draft model that
    is the target itself accepts every greedy draft; layer skip and trained Medusa heads accept
    some on chat prompts."""
    model, prompts, _ = base
    rates = {}
    for method in ("ngram", "draft_model", "layer_skip", "medusa"):
        llm = _spec_llm(model, METHODS[method], medusa_dir)
        chosen = prompts[:len(REPEAT)] if method == "ngram" else prompts[len(REPEAT):]
        llm.generate(chosen, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
        rates[method] = llm.llm_engine.scheduler.spec_stats.acceptance_rate
    assert rates["ngram"] > 0.5, rates
    assert rates["draft_model"] > 0.99, rates
    assert rates["layer_skip"] > 0 and rates["medusa"] > 0, rates


def test_sampled_and_stopped_requests(base):
    """Seeded n=2 sampling is reproducible under speculation; stop strings and max_tokens cut a
    multi-token step exactly where they would cut a plain one; logprobs come for every token."""
    model, prompts, _ = base
    llm = _spec_llm(model, METHODS["ngram"])
    seeded = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=20)
    a = llm.generate(prompts[:3], seeded, use_tqdm=False)
    b = llm.generate(prompts[:3], seeded, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    ref = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0]
    words = ref.text.split()
    stop = " ".join(words[3:5])
    cut = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=stop, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and ref.text.startswith(cut.text)
    assert len(cut.logprobs) == len(cut.token_ids)
    for n in (1, 5, 7):
        short = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)[0].outputs[0]
        assert short.token_ids == ref.token_ids[:n]
    _assert_no_leak(llm)


def test_aborts_leak_nothing(base):
    model, prompts, _ = base
    llm = _spec_llm(model, METHODS["ngram"], num_kv_blocks=64)
    engine = llm.llm_engine
    for round_ in range(3):
        ids = []
        for i, p in enumerate(prompts * 2):
            rid = f"{round_}-{i}"
            engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=30))
            ids.append(rid)
        for step in range(12):
            engine.step()
            if step == 4 + round_:
                engine.abort_request(ids[::2])
        while engine.has_unfinished_requests():
            engine.step()
    _assert_no_leak(llm)
    assert engine.scheduler.spec_stats.num_drafts > 0


@pytest.mark.parametrize("cfg,match", [
    ({"method": "lookahead"}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"model": "/nonexistent/draft", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "layer_skip", "num_layers": 30, "num_speculative_tokens": 2}, "num_layers"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "speculative_config.typo"),
    ('{"method": ', "not valid JSON"),
])
def test_bad_configurations_fail_at_startup(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_engine_config(dtype="float32", device="cpu", speculative_config=cfg)


def test_a_draft_with_another_vocabulary_is_refused(tmp_path, base):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    config = build_engine_config(dtype="float32", device="cpu",
                                 speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens"):
        LLMEngine(config, model=base[0])


def test_backing_off_above_disable_by_batch_size(base):
    """With async scheduling, steps of more than disable_by_batch_size sampling rows are plain
    ones (kept in flight, no drafts) and smaller ones speculate (synchronously): as requests of
    different lengths finish, the engine switches from the one to the other mid-request, and
    the greedy tokens still equal the non-speculative ones."""
    model, prompts, ref = base
    llm = _spec_llm(model, dict(METHODS["ngram"], disable_by_batch_size=3), async_scheduling=True)
    engine = llm.llm_engine
    assert engine.async_scheduling
    lengths = [8, 12, 16, 20, MAX_NEW, MAX_NEW]  # 6 rows, then fewer than 4 after the third finishes
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=n))
    outs, kept_in_flight, synchronous = {}, 0, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        kept_in_flight += engine._inflight is not None
        synchronous += engine._inflight is None and engine.scheduler.num_running > 0
    assert [outs[str(i)] for i in range(len(prompts))] == [r[:n] for r, n in zip(ref, lengths)]
    assert kept_in_flight > 0 and synchronous > 0, (kept_in_flight, synchronous)
    assert engine.scheduler.spec_stats.num_drafts > 0
    _assert_no_leak(llm)


def test_disable_by_batch_size_default_and_explicit_none():
    from minivllm.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE, parse_speculative_config
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}, 30).disable_by_batch_size \
        == DEFAULT_DISABLE_BY_BATCH_SIZE
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": None}, 30)
    assert cfg.disable_by_batch_size is None and cfg.speculates(10 ** 6, False)
    assert not parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}, 30).speculates(
        DEFAULT_DISABLE_BY_BATCH_SIZE + 1, False)


def test_server_with_speculation_and_its_metrics(base):
    """`minivllm serve --speculative-config ...`'s engine (the engine core in its own process):
    greedy text equals the offline engine's, and /metrics counts drafts under vLLM's names."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from minivllm.engine.mp_async_engine import MPAsyncEngine
    from minivllm.server.app import create_app
    from minivllm.server.serving_common import ServerSettings
    from minivllm.server.testing import ServerThread
    _, prompts, ref = base
    engine = MPAsyncEngine.from_kwargs(dtype="float32", device="cpu", speculative_config='{"method": "ngram", '
                                       '"num_speculative_tokens": 4, "prompt_lookup_max": 4}')
    server = ServerThread(create_app(engine, ServerSettings(own_engine=False))).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.completions.create(model=engine.config.model.served_name, prompt=prompts[0]["prompt_token_ids"],
                                      max_tokens=MAX_NEW, temperature=0)
        assert r.choices[0].text == base_tokenizer_decode(ref[0])
        metrics = {s.name: s.value for f in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text)
                   for s in f.samples}
        assert metrics["vllm:spec_decode_num_drafts_total"] > 0
        assert metrics["vllm:spec_decode_num_accepted_tokens_total"] > 0
        assert any(k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos") for k in metrics)
    finally:
        server.stop()
        engine.shutdown()


def base_tokenizer_decode(ids: list[int]) -> str:
    from minivllm.engine.config_builder import build_engine_config
    from minivllm.engine.tokenizer import load_tokenizer
    return load_tokenizer(build_engine_config(dtype="float32", device="cpu").model).decode(ids, skip_special_tokens=True)
