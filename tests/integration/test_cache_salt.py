"""cache_salt through the engine and the server: requests of different tenants never reuse each
other's cached prefix blocks; the same salt (and no salt with no salt) does."""

from __future__ import annotations

import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.async_engine import AsyncEngine
from minivllm.server.app import create_app
from minivllm.server.serving_common import ServerSettings
from minivllm.server.testing import ServerThread

PROMPT = "The history of the printing press begins in the fifteenth century. " * 6  # several full blocks
ONE = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", enable_prefix_caching=True, prefix_caching_hash_algo="sha256")


def _cached(llm, prompt) -> int:
    return llm.generate([prompt], ONE, use_tqdm=False)[0].num_cached_tokens


def test_salts_separate_tenants_offline(llm):
    llm.reset_prefix_cache()
    assert _cached(llm, {"prompt": PROMPT, "cache_salt": "tenant-a"}) == 0
    assert _cached(llm, {"prompt": PROMPT, "cache_salt": "tenant-b"}) == 0  # another tenant: no hit
    assert _cached(llm, PROMPT) == 0  # no salt is a tenant of its own too
    assert _cached(llm, {"prompt": PROMPT, "cache_salt": "tenant-a"}) > 32  # the same tenant hits
    assert _cached(llm, PROMPT) > 32
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt": PROMPT, "cache_salt": ""}], ONE, use_tqdm=False)


def test_salts_through_the_server(llm):
    llm.reset_prefix_cache()
    engine = AsyncEngine(llm.llm_engine)
    server = ServerThread(create_app(engine, ServerSettings(own_engine=False))).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = engine.config.model.served_name

        def hits(salt):
            before = engine.get_stats().prefix_cache_hits
            client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                      extra_body={"cache_salt": salt} if salt else None)
            return engine.get_stats().prefix_cache_hits - before

        assert hits("alpha") == 0
        assert hits("beta") == 0
        assert hits("alpha") > 32
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"cache_salt": ""})
    finally:
        server.stop()
        engine.shutdown()
