"""Mixture-of-experts models under tensor and expert parallelism (mp executor, gloo, fp32 on the
CPU): greedy tokens equal the single-rank engine's token for token.

    tp=2                every rank holds every expert, half of its features (all-reduce)
    tp=2 + EP           each rank holds half the experts, whole (all-reduce, no all_to_all)
    dp=2 + EP           one world over both replicas, tokens sent to their experts' rank and
                        back (all_to_all); a replica with nothing scheduled joins with none
The tiny random models of tiny_moe.py: Qwen3-MoE (8 experts, q/k-norm, a dense layer), Mixtral
(4 experts, w1/w2/w3 names) and Qwen2-MoE (a shared expert, split like a dense MLP)."""

from __future__ import annotations

import pytest
from tiny_moe import PROMPTS, build

from minivllm import LLM, SamplingParams
from minivllm.server.testing import pid_gone

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", skip_tokenizer_init=True, **kw)


def _generate(llm: LLM, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """kind -> (HF directory, the single-rank engine's greedy tokens)."""
    made: dict[str, tuple[str, list[list[int]]]] = {}

    def get(kind: str) -> tuple[str, list[list[int]]]:
        if kind not in made:
            path = str(tmp_path_factory.mktemp(kind))
            build(kind, path)
            llm = _llm(path)
            made[kind] = (path, _generate(llm))
            llm.llm_engine.shutdown()
        return made[kind]
    return get


def _run_parallel(path: str, **kw) -> tuple[list[list[int]], LLM]:
    llm = _llm(path, distributed_executor_backend="mp", **kw)
    try:
        tokens = _generate(llm)
        _check_expert_counts(llm, llm.llm_engine.executor, [MAX_NEW] * len(PROMPTS))
        return tokens, llm
    finally:
        llm.llm_engine.shutdown()


def _check_expert_counts(llm: LLM, source, max_tokens: list[int]) -> None:
    """Every token fed through each sparse layer is counted once per selected expert, whatever
    the ranks (TP ranks all count: only the driver's are read; replicas' are summed); /metrics'
    totals (get_stats) are the per-layer counts summed."""
    moe = llm.llm_engine.config.model.arch.moe
    per_layer = source.expert_token_counts_per_layer()
    fed = sum(len(p) for p in PROMPTS) + sum(n - 1 for n in max_tokens)  # a request's last token is never fed
    assert per_layer and all(len(r) == moe.num_experts and sum(r) == fed * moe.top_k for r in per_layer), per_layer
    assert list(llm.llm_engine.get_stats().expert_token_counts) == [sum(c) for c in zip(*per_layer)]


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_tensor_parallel_equals_one_rank(moe_model, kind):
    path, reference = moe_model(kind)
    got, llm = _run_parallel(path, tensor_parallel_size=2)
    assert got == reference
    assert all(pid_gone(pid) for pid in llm.llm_engine.executor.worker_pids)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_tensor_parallel_with_expert_parallel_equals_one_rank(moe_model, kind):
    path, reference = moe_model(kind)
    got, llm = _run_parallel(path, tensor_parallel_size=2, enable_expert_parallel=True)
    assert got == reference


# requests 0 and 2 go to replica 0, 1 and 3 to replica 1 (least loaded, ties to the first): replica
# 1's are short, so it runs out of work and joins replica 0's steps with idle forwards
UNEVEN = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (MAX_NEW, 2, MAX_NEW + 6, 3)]


def _uneven(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], UNEVEN, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind, tp", [("qwen3_moe", 1), ("qwen2_moe", 2)])
def test_data_parallel_with_expert_parallel_equals_one_replica(moe_model, kind, tp):
    """dp=2 + EP: every rank of both replicas in one world (2 or 4 ranks), tokens dispatched
    to their experts' ranks by all_to_all; one replica idle in the last steps."""
    path, _ = moe_model(kind)
    single = _llm(path)
    reference = _uneven(single)
    single.llm_engine.shutdown()
    llm = _llm(path, data_parallel_size=2, tensor_parallel_size=tp, enable_expert_parallel=True)
    engine = llm.llm_engine
    try:
        got = _uneven(llm)
        assert [len(e.unfinished_request_ids()) for e in engine.replicas] == [0, 0]
        assert all(e.get_stats().generation_tokens > 0 for e in engine.replicas)  # both served requests
        assert engine.num_idle_steps > 0
        _check_expert_counts(llm, engine, [p.max_tokens for p in UNEVEN])
    finally:
        engine.shutdown()
    assert got == reference
    assert all(pid_gone(pid) for e in engine.replicas for pid in e.executor.worker_pids)


def test_expert_parallel_ranks_must_divide_the_experts(moe_model):
    path, _ = moe_model("mixtral")  # 4 experts
    with pytest.raises(ValueError, match=r"enable_expert_parallel needs tensor_parallel_size x data_parallel_size "
                                         r"= 1 x 3 = 3 ranks to divide the model's 4 experts"):
        _llm(path, data_parallel_size=3, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel with data_parallel_size=2 needs "
                                         "distributed_executor_backend='mp'"):
        _llm(path, data_parallel_size=2, enable_expert_parallel=True, distributed_executor_backend="ray")


def test_moe_pipeline_parallel_is_refused(moe_model):
    path, _ = moe_model("mixtral")
    with pytest.raises(ValueError, match="pipeline_parallel_size must be 1 for a mixture-of-experts model"):
        _llm(path, pipeline_parallel_size=2)


def test_expert_parallel_needs_a_moe_model(tiny_llama):
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts model"):
        _llm(tiny_llama(), tensor_parallel_size=2, enable_expert_parallel=True)


def test_gguf_tensor_parallel_equals_one_rank(tmp_path):
    """GGUF's stacked expert tensors (llama.cpp's names) split by features under tp=2."""
    from tiny_moe import write_gguf
    path = str(tmp_path / "qwen2_moe.gguf")
    write_gguf(build("qwen2_moe", seed=1), "qwen2_moe", path)
    single = _llm(path)
    reference = _generate(single)
    single.llm_engine.shutdown()
    got, _ = _run_parallel(path, tensor_parallel_size=2)
    assert got == reference


def _rank_model(path: str, rank, ep=None):
    """One rank's model, built and loaded in this process (loading needs no process group)."""
    import torch

    from minivllm.attention.backend import get_attention_backend
    from minivllm.distributed.communication import TensorParallelGroup
    from minivllm.distributed.parallel_state import ParallelGroups
    from minivllm.engine.config_builder import build_engine_config
    from minivllm.models.loader import build_model
    cfg = build_engine_config(model=path, dtype="float32", device="cpu")
    cpu = torch.device("cpu")
    groups = ParallelGroups(rank, TensorParallelGroup(None, rank.tp_rank, rank.tp_size, cpu), None, ep)
    return build_model(cfg.model, get_attention_backend("torch"), cpu, torch.float32, groups)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "tp+ep"])
def test_each_rank_loads_its_share_of_the_experts(tmp_path, expert_parallel):
    """tp=2: every expert's gate/up rows and down columns of this rank's feature half (and the
    shared expert's); with expert parallelism: whole experts, half of them each."""
    import torch

    from minivllm.distributed.parallel_state import ExpertParallelInfo
    from minivllm.distributed.sharding import RankInfo
    path = str(tmp_path / "qwen2_moe")
    build("qwen2_moe", path)
    full = dict(_rank_model(path, RankInfo()).named_parameters())
    inter, shared, experts = 32, 48, 8
    for r in range(2):
        ep = ExpertParallelInfo(r, 2, False) if expert_parallel else None
        local = dict(_rank_model(path, RankInfo(r, 2), ep).named_parameters())
        sparse = [n for n in local if n.endswith("mlp.experts.w13")]
        assert sparse
        for name in sparse:
            w13, w2 = full[name], full[name.replace("w13", "w2")]
            if expert_parallel:
                own = slice(r * experts // 2, (r + 1) * experts // 2)
                want13, want2 = w13[own], w2[own]
            else:
                half = slice(r * inter // 2, (r + 1) * inter // 2)
                want13 = torch.cat([w13[:, :inter][:, half], w13[:, inter:][:, half]], dim=1)
                want2 = w2[:, :, half]
            assert torch.equal(local[name], want13) and torch.equal(local[name.replace("w13", "w2")], want2)
            gu = name.replace("experts.w13", "shared_expert.gate_up_proj.weight")
            half = slice(r * shared // 2, (r + 1) * shared // 2)
            assert torch.equal(local[gu], torch.cat([full[gu][:shared][half], full[gu][shared:][half]]))
            gate = name.replace("experts.w13", "gate.weight")
            assert torch.equal(local[gate], full[gate])  # the router: replicated
