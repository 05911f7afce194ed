"""The ray backend on the bundled model (9 heads, 3 KV heads, 30 layers): tp=3 and pp=2 as Ray
actors of a local Ray cluster (three logical CPUs) equal one rank token for token offline, and
tp=3 through the server (its engine core in its own process joins the same cluster through
RAY_ADDRESS), with a KV cache small enough to preempt."""

from __future__ import annotations

import httpx
import pytest

ray = pytest.importorskip("ray")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.engine.mp_async_engine import MPAsyncEngine  # noqa: E402
from minivllm.server.app import ServerSettings, create_app  # noqa: E402
from minivllm.server.testing import ServerThread, greedy_completion_texts  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 4,"]
KW = dict(dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=5)  # 80 tokens: preemption
NEW = 12
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "object_store_memory": 100 * 2**20})
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_ADDRESS", c.address)  # the executor (and a child engine core) join this cluster
    yield c
    if ray.is_initialized():
        ray.shutdown()
    mp.undo()
    c.shutdown()


@pytest.fixture(scope="module")
def single():
    llm = LLM(**KW)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    llm.llm_engine.shutdown()
    return [o.outputs[0].text for o in outs], [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=3), dict(pipeline_parallel_size=2)],
                         ids=["tp3", "pp2"])
def test_ray_offline_equals_one_rank(cluster, single, parallel):
    llm = LLM(distributed_executor_backend="ray", **parallel, **KW)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == single[1]
        assert llm.llm_engine.get_stats().num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()


def test_ray_tp3_server_equals_one_rank(cluster, single):
    engine = MPAsyncEngine.from_kwargs(tensor_parallel_size=3, distributed_executor_backend="ray", **KW)
    server = ServerThread(create_app(engine, ServerSettings(own_engine=False))).start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=300) as http:
            assert greedy_completion_texts(http, engine.config.model.served_name, PROMPTS, NEW) == single[0]
    finally:
        server.stop()
        engine.shutdown()
