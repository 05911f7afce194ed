"""Parallel sizes: the shard arithmetic, the startup errors, and sharded loading (each rank's
parameters equal the slice of the full model's), all in one process (loading needs no
communication: a rank's groups are built without a process group)."""

from __future__ import annotations

import pytest
import torch

from minivllm.distributed.communication import TensorParallelGroup
from minivllm.distributed.parallel_state import ParallelGroups
from minivllm.distributed.sharding import RankInfo, ShardPlan, padded_vocab_size, stage_layers
from minivllm.engine.config_builder import build_engine_config


def test_stage_layers_cover_every_layer_once():
    for layers in (1, 4, 30, 31):
        for pp in range(1, min(layers, 7) + 1):
            ranges = [stage_layers(layers, pp, r) for r in range(pp)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert all(end > start for start, end in ranges)


class _Arch:
    num_heads, num_kv_heads, intermediate_size, vocab_size, num_layers = 9, 3, 1536, 49152, 30


@pytest.mark.parametrize("tp", [1, 3])
def test_heads_split_and_kv_heads_replicated(tp):
    plans = [ShardPlan.build(_Arch, RankInfo(r, tp)) for r in range(tp)]
    assert sum(p.num_heads for p in plans) == 9
    # each rank's query heads read the KV heads it holds (GQA: 3 query heads a KV head)
    for r, p in enumerate(plans):
        first_q = r * p.num_heads
        assert p.kv_head_start == first_q // 3
        assert (first_q + p.num_heads - 1) // 3 < p.kv_head_start + p.num_kv_heads
    assert sum(p.vocab_per_rank for p in plans) == (49152 if tp == 1 else padded_vocab_size(49152))


def _cfg(**kw):
    return build_engine_config(dtype="float32", device="cpu", **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_parallel_size=2), "attention heads \\(9\\)"),
    (dict(tensor_parallel_size=9), "intermediate_size \\(1536\\)"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1, got 0"),
    (dict(pipeline_parallel_size=31), "number of layers \\(30\\)"),
    (dict(tensor_parallel_size=3, distributed_executor_backend="uni"), "needs 'mp' or 'ray'"),
    (dict(distributed_executor_backend="threads"), "must be one of"),
    (dict(data_parallel_size=-1), "data_parallel_size"),
])
def test_bad_parallel_sizes_fail_at_startup(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_kv_heads_are_replicated_when_tp_exceeds_them(tiny_llama):
    path = tiny_llama(num_attention_heads=8, num_key_value_heads=2)
    plans = [ShardPlan.build(build_engine_config(model=path, device="cpu").model.arch, RankInfo(r, 8)) for r in range(8)]
    assert [p.kv_head_start for p in plans] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(p.num_kv_heads == 1 and p.num_heads == 1 for p in plans)


def test_tp_must_divide_the_padded_vocabulary(tiny_llama):
    # 6 heads, 3 KV heads, 96 MLP features: tp=3 splits them, but not the 100 tokens padded to 128
    path = tiny_llama(vocab_size=100, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96)
    with pytest.raises(ValueError, match="vocabulary padded to a multiple of 64 \\(100 -> 128\\)"):
        build_engine_config(model=path, dtype="float32", device="cpu", tensor_parallel_size=3)


def test_defaults_and_names():
    cfg = _cfg(tensor_parallel_size=3, pipeline_parallel_size=2)
    p = cfg.parallel
    assert (p.world_size, p.distributed_executor_backend, p.data_parallel_size) == (6, "mp", 1)
    assert _cfg().parallel.distributed_executor_backend == "uni"


def _rank_model(path: str, rank: RankInfo):
    from minivllm.attention.backend import get_attention_backend
    from minivllm.models.loader import build_model
    cfg = build_engine_config(model=path, dtype="float32", device="cpu")
    groups = ParallelGroups(rank, TensorParallelGroup(None, rank.tp_rank, rank.tp_size, torch.device("cpu")), None)
    return build_model(cfg.model, get_attention_backend("torch"), torch.device("cpu"), torch.float32, groups)


@pytest.mark.parametrize("tp, pp", [(2, 1), (4, 1), (2, 2)])
def test_each_rank_holds_its_slice_of_the_full_model(tiny_llama, tp, pp):
    from safetensors.torch import load_file
    path = tiny_llama()
    full = load_file(f"{path}/model.safetensors")
    hd = 64 // 4
    for rank in (RankInfo(t, tp, s, pp) for s in range(pp) for t in range(tp)):
        model = _rank_model(path, rank)
        plan, local = model.plan, dict(model.named_parameters())
        for i, layer in enumerate(range(plan.layer_start, plan.layer_end)):
            w = lambda n: full[f"model.layers.{layer}.{n}.weight"]  # noqa: E731
            q, kv = plan.num_heads * hd, plan.num_kv_heads * hd
            want_qkv = torch.cat([w("self_attn.q_proj")[rank.tp_rank * q:][:q],
                                  w("self_attn.k_proj")[plan.kv_head_start * hd:][:kv],
                                  w("self_attn.v_proj")[plan.kv_head_start * hd:][:kv]])
            assert torch.equal(local[f"layers.{i}.self_attn.qkv_proj.weight"], want_qkv)
            assert torch.equal(local[f"layers.{i}.self_attn.o_proj.weight"], w("self_attn.o_proj")[:, rank.tp_rank * q:][:, :q])
            inter = plan.intermediate_size
            want_gu = torch.cat([w("mlp.gate_proj")[rank.tp_rank * inter:][:inter], w("mlp.up_proj")[rank.tp_rank * inter:][:inter]])
            assert torch.equal(local[f"layers.{i}.mlp.gate_up_proj.weight"], want_gu)
            assert torch.equal(local[f"layers.{i}.mlp.down_proj.weight"], w("mlp.down_proj")[:, rank.tp_rank * inter:][:, :inter])
        assert len(model.layers) == plan.layer_end - plan.layer_start
        rows = slice(plan.vocab_start, plan.vocab_start + plan.vocab_per_rank)
        assert (model.embed_tokens is not None) == rank.is_first_stage
        assert (model.lm_head is not None) == rank.is_last_stage
        if rank.is_first_stage:
            assert torch.equal(model.embed_tokens.weight, full["model.embed_tokens.weight"][rows])
        if rank.is_last_stage:
            assert torch.equal(model.lm_head.weight, full["lm_head.weight"][rows])
