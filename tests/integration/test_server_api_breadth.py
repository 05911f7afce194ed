"""Issue 23 through the server with the `openai` client, on the default engine (engine core in
its own process): beam search, echo + prompt logprobs (max_tokens 0), continuous usage stats,
embeddings, LoRA adapters by name and loaded/unloaded at run time, byte-level logprobs. The
offline LLM on the same settings is the oracle (itself checked against HF in the other tests)."""

from __future__ import annotations

import httpx
import openai
import pytest

from minivllm import LLM, BeamSearchParams, LoRARequest, PoolingParams, SamplingParams
from minivllm.engine.mp_async_engine import MPAsyncEngine
from minivllm.server.app import create_app
from minivllm.server.serving_common import ServerSettings
from minivllm.server.testing import ServerThread

ENGINE_KW = dict(dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_bytes=128 << 20,
                 enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPT = "The capital of France is"
EMOJI = "I love pizza 🍕 and 寿司!"


@pytest.fixture(scope="module")
def adapter_dirs(hf_model, tmp_path_factory):
    from test_lora import make_adapter
    root = tmp_path_factory.mktemp("server_loras")
    make_adapter(hf_model, root / "a", seed=1, rank=8)
    make_adapter(hf_model, root / "b", seed=3, rank=8)
    return str(root / "a"), str(root / "b")


@pytest.fixture(scope="module")
def offline():
    return LLM(**ENGINE_KW)


@pytest.fixture(scope="module")
def server(adapter_dirs):
    engine = MPAsyncEngine.from_kwargs(**ENGINE_KW)
    settings = ServerSettings(own_engine=False, lora_modules=[("sql", adapter_dirs[0])])
    srv = ServerThread(create_app(engine, settings)).start()
    try:
        yield srv.base_url, engine.config.model.served_name
    finally:
        srv.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_beam_search_completions_and_chat(client, server, offline):
    ref = offline.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=6))[0]
    r = client.completions.create(model=server[1], prompt=PROMPT, n=3, max_tokens=6,
                                  extra_body={"use_beam_search": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [s.text for s in ref.sequences]
    chat = client.chat.completions.create(model=server[1], messages=[{"role": "user", "content": "Hi!"}], n=2,
                                          max_tokens=5, extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert len(chat.choices) == 2 and all(c.message.content is not None for c in chat.choices)
    with pytest.raises(openai.BadRequestError):  # silently ignoring top_p would be a lie
        client.completions.create(model=server[1], prompt=PROMPT, n=2, max_tokens=4, top_p=0.5,
                                  extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="n has 17 entries"):  # the server's --max-n
        client.completions.create(model=server[1], prompt=PROMPT, n=17, max_tokens=4,
                                  extra_body={"use_beam_search": True})


def test_echo_prompt_logprobs_max_tokens_zero(client, server, offline):
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    r = client.completions.create(model=server[1], prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text == PROMPT and r.usage.completion_tokens == 0
    lp = c.logprobs
    ids = ref.prompt_token_ids
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - ref.prompt_logprobs[pos][ids[pos]].logprob) < 1e-4
        assert len(lp.top_logprobs[pos]) >= 2
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(c.text)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=server[1], prompt=PROMPT, max_tokens=0)


def test_byte_level_logprobs_rebuild_the_text(client, server):
    r = client.completions.create(model=server[1], prompt=EMOJI, max_tokens=0, echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    assert all(0 <= off <= len(EMOJI) for off in lp.text_offset)
    # offsets count characters: each token starts at or before the character its bytes complete
    assert lp.text_offset == sorted(lp.text_offset)
    # chat: force a token that holds a fragment of the pizza's 4 UTF-8 bytes; its bytes are real
    ids = httpx.post(server[0] + "/tokenize", json={"prompt": "🍕", "add_special_tokens": False}).json()["tokens"]
    assert len(ids) >= 2  # a byte-level model splits the emoji
    chat = client.chat.completions.create(model=server[1], messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1, logprobs=True, logit_bias={str(ids[0]): 100})
    entry = chat.choices[0].logprobs.content[0]
    assert bytes(entry.bytes) != "\ufffd".encode() and bytes(entry.bytes) == "🍕".encode()[:len(entry.bytes)]


def test_continuous_usage_stats(client, server):
    chunks = list(client.completions.create(model=server[1], prompt=PROMPT, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    assert [c.usage.completion_tokens for c in with_choices] == sorted(c.usage.completion_tokens for c in with_choices)
    chat = list(client.chat.completions.create(model=server[1], messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3, stream=True,
                                               stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chat[1:])


def test_embeddings(client, server, offline):
    texts = ["hello world", "the quick brown fox"]
    ref = offline.embed(texts, use_tqdm=False)
    r = client.embeddings.create(model=server[1], input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 0
    for d, o in zip(r.data, ref):
        assert max(abs(a - b) for a, b in zip(d.embedding, o.outputs.embedding)) < 1e-5
    r = client.embeddings.create(model=server[1], input=texts[0], encoding_format="float")
    assert len(r.data[0].embedding) == len(ref[0].outputs.embedding)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=server[1], input="x", dimensions=3)


def test_lora_by_name_and_at_run_time(client, server, offline, adapter_dirs):
    models = [m.id for m in client.models.list().data]
    assert models == [server[1], "sql"]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    refs = [offline.generate([PROMPT], greedy, use_tqdm=False, lora_request=lora)[0].outputs[0].text
            for lora in (None, LoRARequest("a", 1, adapter_dirs[0]), LoRARequest("b", 2, adapter_dirs[1]))]
    assert len(set(refs)) == 3

    def complete(model):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert complete(server[1]) == refs[0] and complete("sql") == refs[1]
    with pytest.raises(openai.NotFoundError):
        complete("later")
    base = server[0] + "/v1"
    assert httpx.post(base + "/load_lora_adapter", json={"lora_name": "later", "lora_path": adapter_dirs[1]}).status_code == 200
    assert complete("later") == refs[2]
    assert "later" in [m.id for m in client.models.list().data]
    bad = httpx.post(base + "/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
    assert httpx.post(base + "/load_lora_adapter", json={"lora_name": "later", "lora_path": adapter_dirs[1]}).status_code == 400
    assert httpx.post(base + "/unload_lora_adapter", json={"lora_name": "later"}).status_code == 200
    assert httpx.post(base + "/unload_lora_adapter", json={"lora_name": "later"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        complete("later")
    assert complete("sql") == refs[1]  # still serving
