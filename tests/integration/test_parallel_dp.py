"""Data parallelism: data_parallel_size replicas behind one LLM (engine/dp_engine.py). Greedy
tokens equal one engine's; requests spread over the replicas by load, and a prompt whose prefix
is resident in one replica goes there; stats are summed with each replica's kept."""

from __future__ import annotations

from minivllm import LLM, SamplingParams
from minivllm.engine.dp_engine import DataParallelEngine

PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 40)), [100, 200, 300], [7] * 20]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_two_replicas_route_by_load_and_prefix(tiny_llama):
    path = tiny_llama()
    kw = dict(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, num_kv_blocks=16)
    single = LLM(**kw)
    want = _tokens(single, PROMPTS)
    single.llm_engine.shutdown()
    llm = LLM(data_parallel_size=2, **kw)
    engine = llm.llm_engine
    try:
        assert isinstance(engine, DataParallelEngine) and len(engine.replicas) == 2
        assert _tokens(llm, PROMPTS) == want
        stats = engine.get_stats()
        # the four prompts were spread by load: each replica ran two (and so computed their prompts)
        assert [s.prompt_tokens for s in stats.replicas] == [5 + 3, 37 + 20]
        assert stats.prompt_tokens == sum(map(len, PROMPTS)) and stats.num_free_blocks == 32
        # a prompt sharing the 37-token prompt's first two blocks goes to the replica holding them
        long_prefix = list(range(3, 40))[:32] + [9, 9, 9]
        replica = engine.route({"prompt_token_ids": long_prefix})
        assert replica is engine.replicas[1]
        assert engine.route({"prompt_token_ids": [8] * 40}) is engine.replicas[0]  # no hit: the least loaded
        # /metrics: one sample per replica, labelled engine="0" and engine="1"
        from types import SimpleNamespace

        from minivllm.server.metrics import _EngineStatsCollector
        fams = {f.name: f for f in _EngineStatsCollector(SimpleNamespace(get_stats=lambda: stats), "tiny").collect()}
        prompt = {s.labels["engine"]: s.value for s in fams["vllm:prompt_tokens"].samples}
        assert prompt == {"0": 8.0, "1": 57.0}
    finally:
        engine.shutdown()


def test_async_engine_serves_a_data_parallel_engine(tiny_llama):
    """The server's engine thread passes add_request every argument (lora_request too)."""
    import asyncio

    from minivllm.engine.async_engine import AsyncEngine
    path = tiny_llama()
    llm = LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, num_kv_blocks=16,
              data_parallel_size=2)
    want = _tokens(llm, [PROMPTS[1]])[0]  # before the engine thread owns the engine
    engine = AsyncEngine(llm.llm_engine)

    async def run() -> list[int]:
        final = None
        async for out in engine.generate({"prompt_token_ids": PROMPTS[1]}, PARAMS, "r1"):
            final = out
        return final.outputs[0].token_ids

    try:
        assert asyncio.run(run()) == want
    finally:
        engine.shutdown()
