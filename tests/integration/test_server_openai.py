"""The OpenAI-compatible server through the official `openai` client (sync and async), on one
in-process server (uvicorn in a thread) over an engine whose offline `LLM.generate` output
is the oracle; plus 64 concurrent streams, client disconnects and /metrics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minivllm import LLM, SamplingParams
from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.mp_async_engine import MPAsyncEngine
from minivllm.engine.tokenizer import apply_chat_template
from minivllm.server.app import create_app
from minivllm.server.serving_common import ServerSettings
from minivllm.server.testing import ServerThread

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "To bake bread, you first", "Water boils at",
           "My favourite programming language is", "The largest planet in the solar system is"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_NEW = 16
CONCURRENT_NEW = 12


@dataclass
class Served:
    base_url: str
    engine: AsyncEngine
    model: str
    tokenizer: object
    offline: list[list[int]]  # greedy token ids of PROMPTS, MAX_NEW tokens (may stop at eos)
    offline_chat: list[int]
    offline_fixed: list[list[int]]  # greedy ids of PROMPTS, CONCURRENT_NEW tokens, ignore_eos


ENGINE_KW = dict(dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="module", params=["engine_process", "engine_thread"])
def served(request):
    """Every test runs against both engines: the engine core in its own process (the server's
    default) and the in-process engine thread over the oracle's own LLMEngine."""
    llm = LLM(**ENGINE_KW)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    offline = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    offline_chat = llm.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    fixed = SamplingParams(temperature=0.0, max_tokens=CONCURRENT_NEW, ignore_eos=True)
    offline_fixed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, fixed, use_tqdm=False)]
    if request.param == "engine_process":
        engine = MPAsyncEngine.from_kwargs(**ENGINE_KW)
    else:
        engine = AsyncEngine(llm.llm_engine)  # from here on only the engine thread touches the engine
    server = ServerThread(create_app(engine, ServerSettings(own_engine=False))).start()
    try:
        yield Served(server.base_url, engine, engine.config.model.served_name, llm.get_tokenizer(), offline,
                     offline_chat, offline_fixed)
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _aclient(served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _ids(served, text: str) -> list[int]:
    return served.tokenizer(text, add_special_tokens=False).input_ids


def _wait_idle(engine: AsyncEngine, timeout_s: float = 30.0) -> None:
    """Until no request runs or waits and no KV block is allocated."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = engine.get_stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_kv_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle after {timeout_s} s: {engine.get_stats()}")


# ---- basic endpoints -----------------------------------------------------------------------------
def test_models_health_version(served, client):
    models = client.models.list().data
    assert [m.id for m in models] == [served.model]
    assert httpx.get(served.base_url + "/health").status_code == 200
    assert httpx.get(served.base_url + "/version").json()["version"]


def test_tokenize_detokenize_roundtrip(served):
    text = "Hello world, this is minivllm."
    r = httpx.post(served.base_url + "/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == served.tokenizer(text).input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    back = httpx.post(served.base_url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == text
    chat = httpx.post(served.base_url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == apply_chat_template(served.tokenizer, CHAT)


# ---- greedy output equals the offline LLM.generate output -----------------------------------------
def test_completion_greedy_matches_offline(served, client):
    r = client.completions.create(model=served.model, prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert choice.text == served.tokenizer.decode(served.offline[0], skip_special_tokens=True)
    assert r.usage.completion_tokens == len(served.offline[0])
    assert r.usage.prompt_tokens == len(_ids(served, PROMPTS[0]))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")


def test_batch_and_token_id_prompts_match_offline(served, client):
    ids = [_ids(served, p) for p in PROMPTS[:3]]
    r = client.completions.create(model=served.model, prompt=ids, max_tokens=MAX_NEW, temperature=0, logprobs=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, want in zip(r.choices, served.offline[:3]):
        assert c.text == served.tokenizer.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == sum(len(i) for i in ids)


def test_chat_greedy_matches_offline(served, client):
    r = client.chat.completions.create(model=served.model, messages=CHAT, max_completion_tokens=MAX_NEW,
                                       temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == served.tokenizer.decode(served.offline_chat, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(apply_chat_template(served.tokenizer, CHAT))
    assert r.usage.completion_tokens == len(served.offline_chat)


def test_chat_content_parts_equal_plain_string(served, client):
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    r = client.chat.completions.create(model=served.model, messages=parts, max_tokens=MAX_NEW, temperature=0)
    assert r.choices[0].message.content == served.tokenizer.decode(served.offline_chat, skip_special_tokens=True)


# ---- streaming ----------------------------------------------------------------------------------
def test_completion_stream_with_usage_equals_non_stream(served, client):
    chunks = list(client.completions.create(model=served.model, prompt=PROMPTS[1], max_tokens=MAX_NEW,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == served.tokenizer.decode(served.offline[1], skip_special_tokens=True)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(served.offline[1])
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_sync(served, client):
    chunks = list(client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=MAX_NEW,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == served.tokenizer.decode(served.offline_chat, skip_special_tokens=True)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_async_client_completion_and_chat_stream(served):
    async def main():
        async with _aclient(served) as ac:
            r = await ac.completions.create(model=served.model, prompt=PROMPTS[2], max_tokens=MAX_NEW, temperature=0)
            stream = await ac.chat.completions.create(model=served.model, messages=CHAT, max_tokens=MAX_NEW,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
            parts, usage = [], None
            async for c in stream:
                parts.extend(ch.delta.content or "" for ch in c.choices)
                usage = c.usage or usage
            return r, "".join(parts), usage
    r, chat_text, usage = asyncio.run(main())
    assert r.choices[0].text == served.tokenizer.decode(served.offline[2], skip_special_tokens=True)
    assert chat_text == served.tokenizer.decode(served.offline_chat, skip_special_tokens=True)
    assert usage.completion_tokens == len(served.offline_chat)


# ---- sampling options -------------------------------------------------------------------------------
def test_n2_with_seed_is_reproducible(served, client):
    def run(seed):
        r = client.completions.create(model=served.model, prompt=PROMPTS[3], max_tokens=12, temperature=1.0,
                                      n=2, seed=seed, extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 24
        return [c.text for c in r.choices]
    first = run(1234)
    assert run(1234) == first
    assert first[0] != first[1] or run(99) != first  # samples differ (with overwhelming probability)
    chat = [client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=10, n=2, seed=7,
                                           temperature=1.0).choices for _ in range(2)]
    assert [c.message.content for c in chat[0]] == [c.message.content for c in chat[1]]


def test_stop_string(served, client):
    full = served.tokenizer.decode(served.offline[0], skip_special_tokens=True)
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    cut = full.index(stop)
    r = client.completions.create(model=served.model, prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0,
                                  stop=[stop, "zzzz-never"])
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=served.model, prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0,
                                  stop=stop, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == full[:cut] + stop


def test_completion_logprobs_and_echo(served, client):
    r = client.completions.create(model=served.model, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 1 <= len(top) <= 4
        assert top[tok] == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    e = client.completions.create(model=served.model, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=1,
                                  echo=True)
    n_prompt = e.usage.prompt_tokens
    assert e.choices[0].text == PROMPTS[0] + r.choices[0].text
    elp = e.choices[0].logprobs
    assert len(elp.tokens) == n_prompt + 6 and elp.token_logprobs[0] is None
    assert elp.tokens[n_prompt:] == lp.tokens
    assert elp.text_offset[n_prompt] == len(PROMPTS[0])


def test_chat_logprobs(served, client):
    r = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for c in content:
        assert len(c.top_logprobs) == 2 and c.token == c.top_logprobs[0].token
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob) and c.bytes == list(c.token.encode())
    stream = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=1, stream=True)
    streamed = [t.token for ch in stream for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert streamed == [c.token for c in content]


# ---- many clients at once -------------------------------------------------------------------------
def test_64_concurrent_streaming_clients(served):
    async def one(ac, i):
        stream = await ac.completions.create(model=served.model, prompt=PROMPTS[i % len(PROMPTS)],
                                             max_tokens=CONCURRENT_NEW, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, finish, usage = "", None, None
        async for c in stream:
            for ch in c.choices:
                text += ch.text
                finish = ch.finish_reason or finish
            usage = c.usage or usage
        return text, finish, usage

    async def main():
        async with _aclient(served) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(64)))
    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    matches = 0
    for i, (text, finish, usage) in enumerate(results):
        assert finish == "length" and usage.completion_tokens == CONCURRENT_NEW, (i, finish, usage)
        matches += text == served.tokenizer.decode(served.offline_fixed[i % len(PROMPTS)], skip_special_tokens=True)
    # batch composition may flip a near-tie argmax in fp32; nearly all must still be identical
    assert matches >= 60, f"only {matches}/64 streams equal the offline greedy output"
    _wait_idle(served.engine)
    print(f"64 concurrent streams in {elapsed:.1f} s, {matches}/64 identical to offline")


# ---- disconnects ----------------------------------------------------------------------------------
def test_stream_disconnect_frees_blocks(served, client):
    _wait_idle(served.engine)
    body = {"model": served.model, "prompt": PROMPTS[4], "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", served.base_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
        assert served.engine.get_stats().num_free_blocks < served.engine.get_stats().num_kv_blocks
    _wait_idle(served.engine, 20)  # the abort freed its blocks well before 500 tokens
    _assert_metric_kv_usage_zero(served)
    assert client.completions.create(model=served.model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_non_stream_disconnect_frees_blocks(served, client):
    _wait_idle(served.engine)
    body = {"model": served.model, "prompt": PROMPTS[5], "max_tokens": 500, "ignore_eos": True}

    async def drop():
        async with httpx.AsyncClient(timeout=60) as c:
            task = asyncio.ensure_future(c.post(served.base_url + "/v1/completions", json=body))
            deadline = time.monotonic() + 30
            while served.engine.get_stats().num_running == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert served.engine.get_stats().num_running == 1
            task.cancel()  # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await task
    asyncio.run(drop())
    _wait_idle(served.engine, 20)
    _assert_metric_kv_usage_zero(served)
    assert client.completions.create(model=served.model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def _assert_metric_kv_usage_zero(served) -> None:
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(served.base_url + "/metrics").text)}
    assert fams["vllm:kv_cache_usage_perc"].samples[0].value == 0.0
    assert fams["vllm:num_requests_running"].samples[0].value == 0.0


# ---- metrics --------------------------------------------------------------------------------------
def _metrics(served) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(served.base_url + "/metrics").text):
        for s in fam.samples:
            assert s.labels.get("model_name") == served.model, s
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name",))
            out[key] = s.value
    return out


def test_metrics_parse_and_move(served, client):
    _wait_idle(served.engine)
    before = _metrics(served)
    for name in ["vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"]:
        assert name in before, name
    r = client.completions.create(model=served.model, prompt=PROMPTS[6], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = _metrics(served)
    key = "vllm:request_success_total|finished_reason=length"
    assert after[key] == before.get(key, 0.0) + 1
    assert after["vllm:generation_tokens_total"] >= before["vllm:generation_tokens_total"] + 5
    assert after["vllm:prompt_tokens_total"] >= before["vllm:prompt_tokens_total"] + r.usage.prompt_tokens
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    for h in ["time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"]:
        assert after[f"vllm:{h}_count"] == before[f"vllm:{h}_count"] + 1, h
    assert after["vllm:inter_token_latency_seconds_count"] >= before["vllm:inter_token_latency_seconds_count"] + 4
    assert after["vllm:e2e_request_latency_seconds_sum"] > before["vllm:e2e_request_latency_seconds_sum"]
