"""The W4 layer tail (kernels/w4_layer_tail.py, one persistent launch for o_proj .. down_proj of a
decode token) against the engine's unfused path (the Triton GEMVs, fused_add_rms_norm,
silu_and_mul) and a float32 reference, on Hopper. Needs nvcc on the machine (the kernel is built
on first use)."""

from __future__ import annotations

import types

import pytest
import torch

from minivllm.quant import w4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs a compute capability 9.0 GPU"),
]


def _linear(n: int, k: int, gen: torch.Generator):
    """A W4A16 layer as the loader leaves it on a GPU (engine layout, interleaved scale-zero pairs)."""
    q = torch.randint(0, 16, (k, n), generator=gen)
    scales = (torch.rand(k // 128, n, generator=gen) * 0.6 + 0.7) * (2.0 / (k ** 0.5 * 8))
    zeros = torch.randint(0, 16, (k // 128, n), generator=gen)
    s, z = w4.interleave_scale_zero(scales.half().cuda(), zeros.half().cuda())
    return types.SimpleNamespace(qweight=w4.pack_engine(q).cuda(), scales=s, zeros=z, in_features=k,
                                 out_features=n, group_size=128)


def _case(q_size: int, hidden: int, inter: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    o, gu, down = _linear(hidden, q_size, gen), _linear(2 * inter, hidden, gen), _linear(hidden, inter, gen)
    norm = types.SimpleNamespace(weight=(1 + 0.1 * torch.randn(hidden, generator=gen)).half().cuda(), eps=1e-5)
    attn = torch.randn(1, q_size, generator=gen).half().cuda()
    residual = (3 * torch.randn(1, hidden, generator=gen)).half().cuda()
    return o, gu, down, norm, attn, residual


def _tail(o, gu, down, norm, qkv=None, input_norm=None):
    from minivllm.kernels import w4_layer_tail as lt
    kmax = max(o.in_features, down.in_features, down.out_features)
    grid = lt.load_library().w4lt_grid(torch.cuda.current_device(), kmax)
    counters = torch.zeros(lt.MAX_STAGES + 1, dtype=torch.int32, device="cuda")
    heads = None if qkv is None else (32, 8, 128)  # Llama-3.1-8B's attention (qkv rows 6,144)
    return lt.W4LayerTail(o, gu, down, norm.weight, norm.eps, counters, grid, qkv,
                          None if input_norm is None else input_norm.weight, heads=heads)


def _unfused(o, gu, down, norm, attn, residual):
    """The engine's path for the same step: three GEMVs, the fused norm and SiLU-and-mul."""
    from minivllm.kernels.fused_ops import fused_add_rms_norm, silu_and_mul
    from minivllm.kernels.w4a16_gemm import w4a16_linear
    h = w4a16_linear(attn, o.qweight, o.scales, o.zeros, 128)
    h, res = fused_add_rms_norm(h, residual, norm.weight, norm.eps)
    a = silu_and_mul(w4a16_linear(h, gu.qweight, gu.scales, gu.zeros, 128))
    return w4a16_linear(a, down.qweight, down.scales, down.zeros, 128), res


def _float32(o, gu, down, norm, attn, residual):
    def lin(x, layer):
        return x.float() @ w4.dequantize(layer.qweight, layer.scales, layer.zeros, 128).t()
    s = lin(attn, o) + residual.float()
    h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
    g, u = lin(h, gu).chunk(2, dim=-1)
    return lin(torch.nn.functional.silu(g) * u, down), s


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


SHAPES = [
    (4096, 4096, 14336),  # Llama-3.1-8B
    (2048, 2048, 4096),   # fewer row tiles than blocks in every stage
    (4096, 2048, 6144),   # q_size != hidden
]


@pytest.mark.parametrize("q_size,hidden,inter", SHAPES)
def test_layer_tail_matches_the_unfused_path(q_size: int, hidden: int, inter: int) -> None:
    case = _case(q_size, hidden, inter)
    tail = _tail(*case[:4])
    out, res = tail(*case[4:])
    ref_out, ref_res = _unfused(*case)
    f32_out, f32_res = _float32(*case)
    assert _rel(res, ref_res) < 2e-3 and _rel(res, f32_res) < 2e-3
    # both fp16 paths sit as close to the float32 product as each other
    e_tail, e_ref = _rel(out, f32_out), _rel(ref_out, f32_out)
    assert e_tail < 1e-2 and e_ref < 1e-2, (e_tail, e_ref)
    assert _rel(out, ref_out) < 1.5e-2


def test_chained_tail_runs_the_next_layers_norm_and_qkv() -> None:
    """Stage 3: the next layer's input_layernorm(mlp_out, residual) and qkv_proj, in the same launch."""
    from minivllm.kernels.fused_ops import fused_add_rms_norm
    from minivllm.kernels.w4a16_gemm import w4a16_linear
    o, gu, down, norm, attn, residual = _case(4096, 4096, 14336, seed=3)
    gen = torch.Generator().manual_seed(9)
    qkv_lin = _linear(4096 + 2 * 1024, 4096, gen)
    in_norm = types.SimpleNamespace(weight=(1 + 0.1 * torch.randn(4096, generator=gen)).half().cuda(), eps=1e-5)
    tail = _tail(o, gu, down, norm)
    nxt = _tail(o, gu, down, norm, qkv_lin, in_norm)  # only its qkv tiles and input norm are used
    mlp_out, res1 = tail(attn, residual)
    qkv, res2 = tail(attn, residual, nxt)
    h, ref_res2 = fused_add_rms_norm(mlp_out, res1, in_norm.weight, in_norm.eps)
    ref_qkv = w4a16_linear(h, qkv_lin.qweight, qkv_lin.scales, qkv_lin.zeros, 128)
    assert torch.equal(res2, ref_res2)  # the same fp16 sum of the same (bit-identical) inputs
    assert qkv.shape == (1, 6144) and _rel(qkv, ref_qkv) < 1e-2


@pytest.mark.parametrize("slot", [37, -1])
def test_chained_tail_rotates_q_and_stores_the_next_layers_kv(slot: int) -> None:
    """OUT_QKV with a RopeTarget: q rotated in qkv, the rotated K and V in the caches at the token's
    slot (none for slot -1), bit for bit what rotary_store_kv does to the unrotated qkv."""
    from minivllm.kernels import w4_layer_tail as lt
    from minivllm.kernels.store_kv import rotary_store_kv
    from minivllm.models.layers import RotaryEmbedding
    o, gu, down, norm, attn, residual = _case(4096, 4096, 14336, seed=6)
    gen = torch.Generator().manual_seed(11)
    qkv_lin = _linear(4096 + 2 * 1024, 4096, gen)
    in_norm = types.SimpleNamespace(weight=(1 + 0.1 * torch.randn(4096, generator=gen)).half().cuda(), eps=1e-5)
    tail, nxt = _tail(o, gu, down, norm), _tail(o, gu, down, norm, qkv_lin, in_norm)
    plain, res = tail(attn, residual, nxt)
    cos_sin = RotaryEmbedding(128, 4096, 500000.0, None).cos_sin.cuda()
    positions = torch.tensor([1234], dtype=torch.int64, device="cuda")
    slots = torch.tensor([slot], dtype=torch.int64, device="cuda")
    caches = [torch.randn(4, 16, 8, 128, device="cuda").half() for _ in range(4)]  # k, v; reference k, v
    caches[2].copy_(caches[0])
    caches[3].copy_(caches[1])
    target = lt.RopeTarget(positions, slots, cos_sin, caches[0], caches[1])
    roped, res_r = tail(attn, residual, nxt, target)
    ref = plain.clone()
    q, k, v = ref.split([4096, 1024, 1024], dim=-1)
    rotary_store_kv(positions, q.view(1, 32, 128), k.view(1, 8, 128), v.view(1, 8, 128), cos_sin, caches[2],
                    caches[3], slots)
    assert torch.equal(res_r, res)
    assert not torch.equal(ref[:, :4096], plain[:, :4096])  # (the position rotates q)
    assert torch.equal(roped, ref)  # q rotated, k and v as the GEMV left them
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("pdl,coop", [("0", "0"), ("1", "0"), ("1", "1")])
def test_layer_tail_with_and_without_pdl(pdl: str, coop: str, monkeypatch) -> None:
    """PDL and the cooperative launch change when the blocks start, not the result."""
    monkeypatch.delenv("MINIVLLM_W4_TAIL_PDL", raising=False)
    monkeypatch.setenv("MINIVLLM_W4_TAIL_COOP", coop)
    case = _case(4096, 4096, 14336, seed=4)
    tail = _tail(*case[:4])
    ref = tail(*case[4:])
    monkeypatch.setenv("MINIVLLM_W4_TAIL_PDL", pdl)
    from minivllm.kernels.fused_ops import silu_and_mul
    for _ in range(5):
        silu_and_mul(torch.randn(1, 2 * 14336, device="cuda").half())  # a PDL kernel before the tail
        out = tail(*case[4:])
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_layer_tail_gives_the_same_bits_every_launch() -> None:
    """No atomics on data: repeated launches (the counters reset by the kernel itself) agree."""
    case = _case(4096, 4096, 14336, seed=1)
    tail = _tail(*case[:4])
    first = [t.clone() for t in tail(*case[4:])]
    for _ in range(30):
        out, res = tail(*case[4:])
        assert torch.equal(out, first[0]) and torch.equal(res, first[1])
    assert int(tail.counters.abs().sum()) == 0


def test_layer_tail_in_a_cuda_graph() -> None:
    o, gu, down, norm, attn, residual = _case(4096, 4096, 14336, seed=2)
    tail = _tail(o, gu, down, norm)
    static_attn, static_res = attn.clone(), residual.clone()
    tail(static_attn, static_res)  # built and warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_res = tail(static_attn, static_res)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        a = torch.randn(1, 4096, generator=gen).half().cuda()
        r = torch.randn(1, 4096, generator=gen).half().cuda()
        static_attn.copy_(a)
        static_res.copy_(r)
        graph.replay()
        e_out, e_res = tail(a, r)
        assert torch.equal(g_out, e_out) and torch.equal(g_res, e_res)


def _small_awq_llama(tmp_path, layers: int = 2) -> str:
    import json
    from minivllm.bench import model_dirs
    d = model_dirs.write_model_dir("llama-3.1-8b", str(tmp_path), model_dirs.awq_quantization_config())
    path = f"{d}/config.json"
    with open(path) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    with open(path, "w") as f:
        json.dump(cfg, f)
    return d


def test_engine_takes_the_tail_for_decode_steps(tmp_path, monkeypatch) -> None:
    """The same greedy tokens with and without the tails (dummy AWQ Llama-3.1-8B shapes, 3 layers,
    CUDA graphs), chained through each next layer's qkv or not, with the rotary in the tail or not,
    and by default (auto: on, nvcc is here and the tiles are small): the tails run every decode
    step, the prompt's step takes the unfused path."""
    from minivllm import LLM, SamplingParams
    model = _small_awq_llama(tmp_path, layers=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100, 164))}]
    tokens = {}
    from minivllm.kernels import w4_layer_tail as lt
    switches = {"T": "MINIVLLM_W4_LAYER_TAIL", "C": "MINIVLLM_W4_TAIL_CHAIN", "R": "MINIVLLM_W4_TAIL_ROPE"}
    for mode, on in (("off", ""), ("layer", "T"), ("chain", "TCR"), ("chain-norope", "TC"), ("auto", "CR")):
        for flag, name in switches.items():
            monkeypatch.setenv(name, "1" if flag in on else "0")
        if mode == "auto":
            monkeypatch.delenv("MINIVLLM_W4_LAYER_TAIL")
        llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="float16", max_model_len=1024,
                  kv_cache_memory_bytes=1 << 30, seed=0)
        runner_model = llm.llm_engine.executor.runner.model
        assert all((layer.tail is not None) == (mode != "off") for layer in runner_model.layers)
        assert runner_model.tail_chain == ("C" in on)
        tokens[mode] = llm.generate(prompts, params)[0].outputs[0].token_ids
        if "C" in on:  # the tail rotates where the env lets it
            i64 = torch.zeros(1, dtype=torch.int64, device="cuda")
            assert (lt.rope_target(runner_model.layers[1].self_attn, i64, i64) is not None) == ("R" in on)
        llm.llm_engine.shutdown()
        del llm, runner_model
        torch.cuda.empty_cache()
    assert len(tokens["chain"]) == 12
    assert tokens["layer"] == tokens["off"] and tokens["chain"] == tokens["off"] == tokens["chain-norope"]
    assert tokens["auto"] == tokens["off"]
