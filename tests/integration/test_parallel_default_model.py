"""Parallelism on the bundled model (9 heads, 3 KV heads, 30 layers): tp=3 over three mp worker
processes, pp=2 and dp=2 equal one rank token for token offline (with a preempting KV cache;
dp=2 has two such caches), tp=3 also through the server, and a killed worker turns the server's /health to 503 and fails the
request in flight. Prompts are short and few: every rank shares this machine's cores."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.mp_async_engine import MPAsyncEngine
from minivllm.server.app import ServerSettings, create_app
from minivllm.server.testing import ServerThread, greedy_completion_texts

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 4,", "Water boils at", "The best way to learn a language is"]
KW = dict(dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=6)  # 96 tokens: preemption
NEW = 16


@pytest.fixture(scope="module")
def single():
    llm = LLM(**KW)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    llm.llm_engine.shutdown()
    return [o.outputs[0].text for o in outs], [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=3), dict(pipeline_parallel_size=2),
                                      dict(data_parallel_size=2)], ids=["tp3", "pp2", "dp2"])
def test_offline_equals_one_rank(single, parallel):
    llm = LLM(**parallel, **KW)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == single[1]
        assert llm.llm_engine.get_stats().num_preemptions > 0 or "data_parallel_size" in parallel
    finally:
        llm.llm_engine.shutdown()


def _workers(engine: MPAsyncEngine) -> list[psutil.Process]:
    core = psutil.Process(engine._proc.pid)
    return [p for p in core.children() if "minivllm.executor.worker" in " ".join(p.cmdline())]


def test_tp3_server_equals_one_rank_and_a_dead_worker_is_unhealthy(single):
    want, _ = single
    engine = MPAsyncEngine.from_kwargs(tensor_parallel_size=3, **KW)
    server = ServerThread(create_app(engine, ServerSettings(own_engine=False))).start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=300) as http:
            assert greedy_completion_texts(http, engine.config.model.served_name, PROMPTS, NEW) == want
            workers = _workers(engine)
            assert len(workers) == 3 and http.get("/health").status_code == 200
            os.kill(workers[2].pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while http.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert http.get("/health").status_code == 503
            psutil.wait_procs(workers, timeout=20)
            assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    finally:
        server.stop()
        engine.shutdown()
