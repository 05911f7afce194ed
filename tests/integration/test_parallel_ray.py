"""The ray executor on a simulated two-node Ray cluster (ray.cluster_utils.Cluster: two raylets
on this machine, one logical CPU each, so the two ranks of tp=2 land on different nodes): greedy
tokens equal one rank's, and a killed rank fails every request."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from minivllm import LLM, SamplingParams
from minivllm.server.testing import pid_gone  # noqa: E402

PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 40)), [100, 200, 300], [7] * 20]


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20})
    cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                         use_tqdm=False)]


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, num_kv_blocks=5, **kw)


def test_tp2_across_two_nodes_equals_one_rank(tiny_llama, two_nodes):
    path = tiny_llama()
    single = _llm(path)
    want = _generate(single)
    single.llm_engine.shutdown()
    llm = _llm(path, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        executor = llm.llm_engine.executor
        assert len(set(executor.node_ids)) == 2  # one rank on each node
        assert _generate(llm) == want
        assert llm.llm_engine.get_stats().num_preemptions > 0
        # a rank killed mid-generation: every request ends with an error
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        for i, p in enumerate([PROMPTS[0], PROMPTS[2]]):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        outputs = engine.step() + engine.step()
        ray.kill(executor._actors[1])
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert {o.request_id: o.outputs[0].finish_reason for o in outputs if o.finished} == {"0": "error", "1": "error"}
        assert engine.dead_error is not None
    finally:
        llm.llm_engine.shutdown()
    assert all(pid_gone(pid) for pid in executor.worker_pids)  # (both nodes are this machine)

