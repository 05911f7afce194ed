"""Several models behind one server (server/multi_model.py): the default model twice under two
names, each engine with its own KV pool (half the budget each); requests routed by `model`
under concurrent load answer as one request alone does; /v1/models lists both, /metrics carries
both model_names, an unknown model is a 404. Shares over 100 % are refused at startup."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.mp_async_engine import MPAsyncEngine
from minivllm.models.source import default_gguf_path
from minivllm.server.app import create_app
from minivllm.server.cli import _served_models, register, server_settings
from minivllm.server.multi_model import ModelRouter, model_specs
from minivllm.server.testing import ServerThread

KV_BYTES = 64 << 20
PROMPTS = ["The capital of France is", "Once upon a time,", "def add(a, b):", "The three primary colors are"]


def _serve_args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    path = default_gguf_path()
    return p.parse_args(["serve", "--model", path, "--model", path, "--served-model-name", "alpha", "beta",
                         "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
                         "--kv-cache-memory-bytes", str(KV_BYTES), "--no-engine-process", *extra])


@pytest.fixture(scope="module")
def two_models():
    args = _serve_args()
    served = _served_models(args, server_settings(args))
    # one engine core in its own process (the server's default), one on a thread: both kinds behind the router
    engines = [cls.from_kwargs(**kw) for cls, (kw, _) in zip((MPAsyncEngine, AsyncEngine), served)]
    import dataclasses
    apps = [create_app(e, dataclasses.replace(s, own_engine=False)) for e, (_, s) in zip(engines, served)]
    server = ServerThread(ModelRouter(apps)).start()
    try:
        yield server.base_url, engines
    finally:
        server.stop()
        for e in engines:
            e.shutdown()


async def _complete(client: httpx.AsyncClient, model: str, prompt: str) -> dict:
    r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12,
                                                   "temperature": 0.0})
    assert r.status_code == 200, r.text
    return r.json()


def test_each_model_answers_under_concurrent_load(two_models):
    base_url, engines = two_models

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            alone = [await _complete(client, "alpha", p) for p in PROMPTS]
            both = await asyncio.gather(*[_complete(client, m, p) for p in PROMPTS * 2 for m in ("alpha", "beta")])
            return alone, both

    alone, both = asyncio.run(run())
    want = [a["choices"][0]["text"] for a in alone]
    for i, r in enumerate(both):
        assert r["model"] == ("alpha", "beta")[i % 2]
        assert r["choices"][0]["text"] == want[(i // 2) % len(PROMPTS)]
    for e in engines:  # both engines served, each in its own pool of half the budget
        stats = e.get_stats()
        assert stats.generation_tokens > 0 and stats.num_free_blocks == stats.num_kv_blocks
        per_block = e.config.model.arch.num_layers * 2 * 16 * e.config.model.arch.num_kv_heads * \
            e.config.model.arch.head_dim * 4
        assert stats.num_kv_blocks == (KV_BYTES // 2) // per_block


def test_models_listed_metrics_labelled_unknown_404(two_models):
    base_url, _ = two_models
    with httpx.Client(base_url=base_url, timeout=60) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["alpha", "beta"]
        r = client.post("/v1/completions", json={"model": "gamma", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = client.post("/v1/chat/completions", json={"model": "beta", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "beta"
        text = client.get("/metrics").text
        assert 'vllm:generation_tokens_total{model_name="alpha"}' in text
        assert 'vllm:generation_tokens_total{model_name="beta"}' in text
        assert client.get("/health").status_code == 200


def test_memory_shares_are_checked(tmp_path):
    with pytest.raises(ValueError, match="100 %"):
        model_specs([], _yaml(tmp_path, [("a", 0.7), ("b", 0.5)]), {})
    with pytest.raises(ValueError, match="memory_share must be in"):
        model_specs([], _yaml(tmp_path, [("a", 1.5)]), {})
    with pytest.raises(ValueError, match="served_model_name must differ"):
        model_specs(["m", "m"], None, {})
    specs = model_specs([], _yaml(tmp_path, [("a", 0.25), ("b", None), ("c", None)]), {"dtype": "float32"})
    assert [s.kwargs["memory_share"] for s in specs] == [0.25, 0.375, 0.375]
    assert all(s.kwargs["dtype"] == "float32" for s in specs)
    args = _serve_args("--served-model-name", "only-one")
    with pytest.raises(ValueError, match="one name per --model"):
        _served_models(args, server_settings(args))


def _yaml(tmp_path, entries) -> str:
    lines = ["models:"]
    for name, share in entries:
        lines += [f"  - model: {name}", f"    served_model_name: {name}"]
        if share is not None:
            lines.append(f"    memory_share: {share}")
    path = tmp_path / "models.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)
