"""Programmatic dependent launch (kernels/pdl.py) on the GPU: a chain of the decode path's
kernels, each reading what the one before wrote, gives the same bits with PDL on as off, eager
and replayed from a CUDA graph with new inputs; and a whole MoE model's greedy decode is the
same token for token and logprob for logprob. A kernel that read its input before waiting for
the kernel that writes it would read the previous replay's (or layer's) values here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a Hopper (sm_90+) GPU")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

H, I, E, TOP_K, HEAD = 2048, 768, 128, 8, 128


def _weights(seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to("cuda", torch.bfloat16)  # noqa: E731
    from minivllm.quant import w4
    q = torch.randint(0, 16, (H, 1024), generator=g, dtype=torch.int32)
    return dict(
        norm=rnd(H, scale=0.1) + 1, qkv=rnd(6 * HEAD, H, scale=H ** -0.5), qn=rnd(HEAD, scale=0.1) + 1,
        kn=rnd(HEAD, scale=0.1) + 1, router=rnd(E, H, scale=H ** -0.5), w13=rnd(E, 2 * I, H, scale=H ** -0.5),
        w2=rnd(E, H, I, scale=I ** -0.5), cos_sin=torch.randn(64, HEAD, generator=g).cuda(),
        qw=w4.pack_engine(q).cuda(), s=(torch.rand(H // 128, 1024, generator=g) * 0.01).to("cuda", torch.float16),
        z=torch.full((H // 128, 1024), 8.0, device="cuda", dtype=torch.float16))


def _layer_chain(x, res, w, pos, layers: int = 3):
    """Norm -> qkv GEMV -> q/k norm + rotary (in place on the GEMV's output) -> norm -> router
    GEMV -> top-k -> the two expert GEMVs -> W4A16 GEMV, `layers` times: each kernel consumes
    the one before."""
    from minivllm.kernels.dense_gemv import dense_gemv
    from minivllm.kernels.fused_moe import fused_moe_triton, topk_softmax_triton
    from minivllm.kernels.fused_ops import apply_rotary_triton, fused_add_rms_norm_triton, rms_norm_triton
    from minivllm.kernels.w4a16_gemm import w4a16_gemm
    outs = []
    for _ in range(layers):
        h, res = fused_add_rms_norm_triton(x, res, w["norm"], 1e-6)
        qkv = dense_gemv(h, w["qkv"])  # [1, 6 * HEAD]: 4 q heads, 1 k head, 1 v head
        q = qkv[:, :4 * HEAD].view(1, 4, HEAD)
        k = qkv[:, 4 * HEAD:5 * HEAD].view(1, 1, HEAD)
        apply_rotary_triton(pos, q, k, w["cos_sin"], w["qn"], w["kn"], 1e-6)
        h2 = rms_norm_triton(q.reshape(1, -1).repeat(1, H // (4 * HEAD)) + h, w["norm"], 1e-6)  # reads the rotated q
        weights, ids = topk_softmax_triton(dense_gemv(h2, w["router"]), TOP_K, True)
        moe = fused_moe_triton(h2, w["w13"], w["w2"], weights, ids)
        x = w4a16_gemm(moe.half(), w["qw"], w["s"], w["z"], 128)[:, :H // 2].to(torch.bfloat16).repeat(1, 2)
        outs += [qkv, weights, ids, moe, x]
    return outs


def _run(monkeypatch, pdl: str, inputs, w, graph: bool):
    monkeypatch.setenv("MINIVLLM_PDL", pdl)
    x, res, pos = (t.clone() for t in inputs[0])
    _layer_chain(x, res, w, pos)  # compile, size the split-K counters
    torch.cuda.synchronize()
    if not graph:
        results = []
        for xi, ri, pi in inputs:
            results.append([t.clone() for t in _layer_chain(xi.clone(), ri.clone(), w, pi)])
        return results
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = _layer_chain(x, res, w, pos)
    results = []
    for xi, ri, pi in inputs:  # new inputs each replay: stale reads would show
        x.copy_(xi)
        res.copy_(ri)
        pos.copy_(pi)
        g.replay()
        results.append([t.clone() for t in outs])
    return results


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_decode_kernel_chain_same_bits_with_pdl(monkeypatch, graph):
    w = _weights(0)
    g = torch.Generator(device="cpu").manual_seed(1)
    inputs = [(torch.randn(1, H, generator=g).to("cuda", torch.bfloat16),
               torch.randn(1, H, generator=g).to("cuda", torch.bfloat16),
               torch.tensor([i * 7 % 64], device="cuda")) for i in range(4)]
    off = _run(monkeypatch, "0", inputs, w, graph)
    on = _run(monkeypatch, "1", inputs, w, graph)
    for step, (a, b) in enumerate(zip(off, on)):
        for i, (ta, tb) in enumerate(zip(a, b)):
            assert torch.equal(ta, tb), (step, i)
    assert not all(torch.equal(a, b) for a, b in zip(off[0], off[1]))  # the inputs did change the results


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_moe_model_decode_same_with_pdl(monkeypatch, eager, tmp_path):
    from tiny_moe import PROMPTS, build

    from minivllm import LLM, SamplingParams
    path = str(tmp_path / "qwen3_moe")
    build("qwen3_moe", path)
    results = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("MINIVLLM_PDL", pdl)
        llm = LLM(model=path, device="cuda", dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=eager,
                  kv_cache_memory_bytes=1 << 28, max_num_seqs=4, max_num_batched_tokens=256)
        outs = [llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=24, logprobs=1),
                             use_tqdm=False)[0].outputs[0] for p in PROMPTS]  # batch 1: the one-token kernels
        results[pdl] = [(o.token_ids, [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)]) for o in outs]
        del llm
        torch.cuda.empty_cache()
    assert results["1"] == results["0"]
