"""MoE under tensor and expert parallelism on GPUs (NCCL): the Triton kernel's expert-parallel
share (ids of other ranks' experts -1) on one GPU; the tiny MoE models with tp=2, tp=2 + EP and
dp=2 + EP against one GPU in fp32 on two GPUs (skipped with fewer)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from minivllm.kernels.fused_moe import fused_moe_reference, fused_moe_triton, topk_softmax_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("t", [1, 37, 600])
def test_triton_expert_parallel_shares_sum_to_the_whole(t):
    """Two ranks of 64 experts each (Qwen3-30B-A3B's 128, width 768): each computes its experts'
    entries only (local_only, other ids -1); the shares sum to every expert's output."""
    g = torch.Generator().manual_seed(t)
    e, k, hidden, inter = 128, 8, 512, 768
    x = torch.randn(t, hidden, generator=g).cuda().bfloat16()
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) / hidden ** 0.5).cuda().bfloat16()
    w2 = (torch.randn(e, hidden, inter, generator=g) / inter ** 0.5).cuda().bfloat16()
    weights, ids = topk_softmax_reference(torch.randn(t, e, generator=g), k, renormalize=True)
    weights, ids = weights.cuda(), ids.cuda()
    total = torch.zeros(t, hidden, device="cuda", dtype=torch.float32)
    for rank in range(2):
        local = ids - rank * 64
        local = torch.where((local >= 0) & (local < 64), local, -1).to(torch.int32)
        own = slice(rank * 64, (rank + 1) * 64)
        total += fused_moe_triton(x, w13[own], w2[own], weights, local, local_only=True).float()
    want = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    err = ((total - want).norm() / want.norm()).item()
    assert err < 1.6e-2, err


def _tiny(kind: str, path: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from tiny_moe import build
    build(kind, path)


def _tokens(path: str, **kw) -> list[list[int]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from tiny_moe import PROMPTS

    from minivllm import LLM, SamplingParams
    llm = LLM(model=path, device="cuda", dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 28,
              max_num_seqs=8, max_num_batched_tokens=256, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_tiny_moe_parallel_layouts_equal_one_gpu(kind, tmp_path):
    path = str(tmp_path / kind)
    _tiny(kind, path)
    want = _tokens(path)
    assert _tokens(path, tensor_parallel_size=2) == want
    assert _tokens(path, tensor_parallel_size=2, enable_expert_parallel=True) == want
    assert _tokens(path, data_parallel_size=2, enable_expert_parallel=True) == want
