"""The MoE layer's CPU path against Hugging Face's modules, and its pieces: the router, the
expert-grouped reference, the token counters, the alignment reference's layout, the
expert-parallel placement and the single-rank dispatch."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.fused_moe import count_expert_tokens, fused_moe, fused_moe_reference, topk_softmax_reference
from minivllm.kernels.moe_align import max_padded_rows, moe_align_reference
from minivllm.models.arch import ArchConfig, MoEConfig
from minivllm.models.expert_parallel import ExpertPlacement, LocalComm, expert_parallel_moe
from minivllm.models.moe import FusedMoE, SparseMoeBlock


def _naive_moe(x, w13, w2, weights, ids):
    """Token by token, expert by expert: the definition of the layer."""
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


def _case(t=9, e=6, k=2, hidden=16, inter=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) / 4
    w2 = torch.randn(e, hidden, inter, generator=g) / 4
    weights, ids = topk_softmax_reference(torch.randn(t, e, generator=g), k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("k,e", [(2, 6), (1, 3), (4, 4)])
def test_reference_equals_definition(k, e):
    x, w13, w2, weights, ids = _case(k=k, e=e)
    torch.testing.assert_close(fused_moe_reference(x, w13, w2, weights, ids), _naive_moe(x, w13, w2, weights, ids))


@pytest.mark.parametrize("renorm", [True, False])
def test_router_matches_hf(renorm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                               norm_topk_prob=renorm))
    torch.nn.init.normal_(router.weight)
    x = torch.randn(11, 16)
    _, hf_w, hf_ids = router(x)
    w, ids = topk_softmax_reference(x @ router.weight.T, 3, renorm)
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(w, hf_w.float())
    assert torch.allclose(w.sum(-1), torch.ones(11)) == renorm


def test_sparse_block_matches_hf_qwen2_moe_block():
    """Router + experts + sigmoid-gated shared expert, with weights copied from HF's block."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    hf_cfg = Qwen2MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
                            shared_expert_intermediate_size=20, norm_topk_prob=False)
    hf = Qwen2MoeSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = SparseMoeBlock(16, MoEConfig(6, 2, 12, False, shared_expert_intermediate_size=20))
    sd = hf.state_dict()
    with torch.no_grad():
        ours.gate.weight.copy_(sd["gate.weight"])
        ours.experts.w13.copy_(sd["experts.gate_up_proj"])
        ours.experts.w2.copy_(sd["experts.down_proj"])
        ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([sd["shared_expert.gate_proj.weight"],
                                                                sd["shared_expert.up_proj.weight"]]))
        ours.shared_expert.down_proj.weight.copy_(sd["shared_expert.down_proj.weight"])
        ours.shared_expert_gate.weight.copy_(sd["shared_expert_gate.weight"])
    x = torch.randn(10, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x.unsqueeze(0))[0], rtol=1e-5, atol=1e-6)
    assert int(ours.token_counts.sum()) == 10 * 2


def test_token_counters_skip_invalid_tokens():
    x, w13, w2, weights, ids = _case(t=7, e=5, k=2)
    stats = torch.zeros(5, dtype=torch.int64)
    valid = torch.tensor([True, False, True, True, False, True, True])
    fused_moe(x, w13, w2, weights, ids, stats=stats, token_valid=valid)
    assert torch.equal(stats, torch.bincount(ids[valid].reshape(-1).long(), minlength=5))
    count_expert_tokens(stats, ids, None)
    assert int(stats.sum()) == (5 + 7) * 2


def test_token_counters_ignore_ids_past_the_experts():
    """A CUDA graph's padding rows may route to any id (NaN router logits): the counters skip
    ids outside [0, E) instead of faulting (a device-side assert on the GPU)."""
    stats = torch.zeros(4, dtype=torch.int64)
    count_expert_tokens(stats, torch.tensor([[0, 3], [4, -1], [2, 2]]), torch.tensor([True, True, False]))
    assert stats.tolist() == [1, 0, 0, 1]


def test_align_reference_layout():
    """Each expert's entries form one run, in entry order, padded to the block with the
    sentinel; every block is one expert's."""
    ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]], dtype=torch.int32)
    sorted_ids, block_expert, num_padded = moe_align_reference(ids, 4, 4)
    n = ids.numel()
    assert sorted_ids.shape[0] == max_padded_rows(8, 4, 4) == 20
    assert sorted_ids[:12].tolist() == [1, 2, 6, n, 3, 5, n, n, 0, 4, 7, n]
    assert block_expert.tolist() == [0, 1, 2, -1, -1] and num_padded.item() == 12


def test_placement_divides_experts():
    p = ExpertPlacement(8, size=4, rank=3)
    assert (p.num_local, p.first, p.owns(6), p.owns(5)) == (2, 6, True, False)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by the expert-parallel size 4"):
        ExpertPlacement(6, size=4, rank=0)
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        ExpertPlacement(8, size=2, rank=2)


def test_replicated_token_ranks_sum_to_all_experts():
    """Expert parallelism over TP ranks (no communicator): each rank computes its own experts'
    share of the same tokens (ids of other ranks' experts are -1 locally); the shares sum (the
    TP all-reduce) to the output of one layer holding every expert. Counters see global ids."""
    x, w13, w2, weights, ids = _case(t=12, e=8, k=3)
    total = torch.zeros_like(x)
    for rank in range(2):
        part = FusedMoE(16, 12, ExpertPlacement(8, size=2, rank=rank))
        with torch.no_grad():
            part.w13.copy_(w13[rank * 4:(rank + 1) * 4])
            part.w2.copy_(w2[rank * 4:(rank + 1) * 4])
            stats = torch.zeros(8, dtype=torch.int64)
            total += part(x, weights, ids, stats=stats)
        assert stats.tolist() == torch.bincount(ids.reshape(-1).long(), minlength=8).tolist()
        local = part.local_ids(ids)
        assert ((local >= 0) == ((ids >= rank * 4) & (ids < rank * 4 + 4))).all()
    torch.testing.assert_close(total, fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_feature_slices_sum_to_the_whole():
    """Every expert split by intermediate features (w13 gate/up rows, w2 columns): the slices'
    outputs sum to the whole expert's."""
    x, w13, w2, weights, ids = _case(t=12, e=8, k=3)
    inter = w2.shape[2]
    half = inter // 2
    total = torch.zeros_like(x)
    for r in range(2):
        rows = torch.cat([w13[:, r * half:(r + 1) * half], w13[:, inter + r * half:inter + (r + 1) * half]], dim=1)
        total += fused_moe_reference(x, rows, w2[:, :, r * half:(r + 1) * half], weights, ids)
    torch.testing.assert_close(total, fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_single_rank_dispatch_equals_fused():
    x, w13, w2, weights, ids = _case(t=12, e=8, k=3)
    local = FusedMoE(16, 12, ExpertPlacement(8))
    with torch.no_grad():
        local.w13.copy_(w13)
        local.w2.copy_(w2)
        out = expert_parallel_moe(x, weights, ids, ExpertPlacement(8), LocalComm(), local._local)
    torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-6, atol=1e-6)


def test_moe_config_from_hf_and_bundled_30b():
    from minivllm.bench.model_dirs import load_config
    arch = ArchConfig.from_hf_dict(load_config("qwen3-30b-a3b"))
    assert arch.moe == MoEConfig(128, 8, 768, True)
    assert all(arch.is_moe_layer(i) for i in range(arch.num_layers))
    mixtral = ArchConfig.from_hf_dict({"architectures": ["MixtralForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                                       "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
                                       "num_local_experts": 8, "num_experts_per_tok": 2})
    assert mixtral.moe == MoEConfig(8, 2, 24, True)
    with pytest.raises(ValueError, match="num_experts_per_tok must be in"):
        MoEConfig(4, 0, 8, True)
