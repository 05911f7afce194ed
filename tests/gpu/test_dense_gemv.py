"""The dense batch-1 GEMV (kernels/dense_gemv.py) against F.linear in float64.

`check_dense_gemv` is device-agnostic: tests/unit/test_dense_gemv_interpret.py runs it on the
CPU under Triton's interpreter with small shapes; the tests here run it on the GPU with the
benchmark models' shapes, in eager mode and inside a CUDA graph (the split-K counters must be
back to 0 after every replay). Outputs are written into NaN-poisoned memory first (an unwritten
element stays NaN).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative, per row


def _case(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int, bias: bool, x_stride: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(m, k + x_stride, generator=g).to(dtype)[:, :k]  # x_stride > 0: strided rows
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return xs.to(device), w.to(device), None if b is None else b.to(device)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("inf")
    diff = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-9)
    return diff.max().item()


def check_dense_gemv(m: int, n: int, k: int, dtype: torch.dtype, device: str, tile: dict, split_k: int | None,
                     bias: bool = False, seed: int = 0, x_stride: int = 0) -> float:
    """Worst per-row relative error of dense_gemv against float64 F.linear."""
    from minivllm.kernels.dense_gemv import dense_gemv
    x, w, b = _case(m, n, k, dtype, device, seed, bias, x_stride)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    return _rel_err(dense_gemv(x, w, b, tile, split_k), ref)


def check_dense_gemv_stream(n: int, k: int, dtype: torch.dtype, device: str, tile: dict, bias: bool = False,
                            seed: int = 0) -> float:
    """Worst relative error of the streaming GEMV (one row) against float64 F.linear."""
    from minivllm.kernels.dense_gemv import dense_gemv_stream
    x, w, b = _case(1, n, k, dtype, device, seed, bias)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    return _rel_err(dense_gemv_stream(x, w, b, tile), ref)


def check_gemv_linear_rows(device: str, dtype: torch.dtype) -> dict[str, float]:
    """GemvLinear: 1 and 2 rows through the GEMV, 3 and 9 through F.linear; each against float64."""
    from minivllm.kernels.dense_gemv import GEMV_MAX_ROWS, GemvLinear
    lin = torch.nn.Linear(96, 40, bias=True).to(device=device, dtype=dtype)
    layer = GemvLinear(lin, {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 2, "num_stages": 1, "SPLIT_K": 2})
    assert layer.weight is lin.weight  # the same Parameter (tied weights stay tied)
    out = {}
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 9):
        x = torch.randn(rows, 96, device=device).to(dtype)
        ref = F.linear(x.double(), lin.weight.double(), lin.bias.double())
        out[f"rows {rows}"] = _rel_err(layer(x), ref)
    return out


# ---------------------------------------------------------------- GPU tests

gpu = pytest.mark.gpu
SHAPES = [(2048, 5120), (4096, 2048), (2048, 128), (576, 960), (1536, 576), (4096, 6144), (14336, 4096)]  # (K, N)


@gpu
@pytest.mark.parametrize("k, n", [s for s in SHAPES if s[0] <= 4096])
def test_dense_gemv_stream_matches_linear_on_gpu(k: int, n: int) -> None:
    for tile in ({"BLOCK_N": 2, "num_warps": 4, "programs_per_sm": 2},
                 {"BLOCK_N": 4, "num_warps": 8, "programs": 7}):  # several tiles a program
        err = check_dense_gemv_stream(n, k, torch.bfloat16, "cuda", tile, bias=n % 2 == 0, seed=k + n)
        assert err < TOL[torch.bfloat16], (k, n, tile, err)


@gpu
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", [1, 2])
def test_dense_gemv_matches_linear_on_gpu(k: int, n: int, m: int) -> None:
    from minivllm.kernels.dense_gemv import DEFAULT_TILE
    for split in (None, 1, 4):
        err = check_dense_gemv(m, n, k, torch.bfloat16, "cuda", DEFAULT_TILE, split, bias=n == 128, seed=k + n)
        assert err < TOL[torch.bfloat16], (k, n, m, split, err)


@gpu
def test_dense_gemv_in_a_cuda_graph_replays_correctly() -> None:
    """Split-K in a graph: the counters reset themselves, so every replay gives the right answer
    for new inputs copied into the captured buffers."""
    from minivllm.kernels.dense_gemv import dense_gemv
    k, n = 4096, 2048
    x, w, _ = _case(1, n, k, torch.bfloat16, "cuda", 1, False)
    tile = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
    dense_gemv(x, w, None, tile, 8)  # sizes the counters outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dense_gemv(x, w, None, tile, 8)
    for seed in range(4):
        x.copy_(torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, F.linear(x.double(), w.double())) < TOL[torch.bfloat16]


@gpu
def test_gemv_linear_rows_on_gpu() -> None:
    for name, err in check_gemv_linear_rows("cuda", torch.bfloat16).items():
        assert err < TOL[torch.bfloat16], (name, err)


SMALL = {  # Qwen3 features, 4 layers, random HF weights with real logit margins (quick to build)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "attention_bias": False, "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": 151645,
}


def _random_model_dir(path) -> str:
    import json

    from transformers import AutoConfig, AutoModelForCausalLM
    (path / "config.json").write_text(json.dumps(SMALL))
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(str(path))
    config.initializer_range = 0.05  # larger than the default 0.02 so logits have real margins
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(str(path))
    return str(path)


def _engine_run(model_dir: str, mode: str, monkeypatch):
    """Greedy tokens and their logprobs for a few batch-1 requests with MINIVLLM_DENSE_GEMV=mode,
    the number of decoder linears on the GEMV, and the GEMV kernel's compiled variants after
    startup and after serving (no compile may happen while serving)."""
    from minivllm import LLM, SamplingParams
    from minivllm.kernels import dense_gemv
    monkeypatch.setenv("MINIVLLM_DENSE_GEMV", mode)
    # an explicit KV budget: the kernel tests before this one leave memory in the caching allocator, and
    # lease 13 found no block left under gpu_memory_utilization=0.3
    llm = LLM(model=model_dir, skip_tokenizer_init=True, max_model_len=512, seed=0, kv_cache_memory_bytes=1 << 30)
    model = llm.llm_engine.executor.runner.model
    on_gemv = sum(isinstance(m, dense_gemv.GemvLinear) for m in model.modules())
    variants = lambda: sum(len(c[0]) for c in dense_gemv._dense_gemv_kernel.device_caches.values())  # noqa: E731
    compiled = variants()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = [llm.generate([{"prompt_token_ids": [(97 * i + 31 * j) % 150000 + 3 for j in range(20 + 7 * i)]}],
                         params, use_tqdm=False)[0].outputs[0] for i in range(4)]
    out = ([list(r.token_ids) for r in runs], [[lp[t].logprob for lp, t in zip(r.logprobs, r.token_ids)] for r in runs],
           on_gemv, compiled, variants())
    llm.llm_engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    return out


@gpu
def test_engine_on_the_gemv_agrees_with_cublas(tmp_path, monkeypatch):
    """MINIVLLM_DENSE_GEMV=1 puts every decoder linear of a batch-1 decode step on the GEMV (0:
    none); greedy decoding agrees with the cuBLAS engine (bf16: while the tokens agree, each
    token's logprob within 0.1; most tokens equal), and the GEMV compiles at startup only."""
    model_dir = _random_model_dir(tmp_path)
    tokens_on, lps_on, n_on, compiled, after = _engine_run(model_dir, "1", monkeypatch)
    tokens_off, lps_off, n_off, _, _ = _engine_run(model_dir, "0", monkeypatch)
    assert n_on == 4 * 4 and n_off == 0  # qkv, o, gate_up, down of each of the 4 layers
    assert compiled >= 1 and after == compiled, (compiled, after)
    same = compared = 0
    for ta, tb, la, lb in zip(tokens_on, tokens_off, lps_on, lps_off):
        for i, (x, y) in enumerate(zip(ta, tb)):
            if x != y:
                break
            same += 1
            if i >= 1:  # a decode step's token (the first comes from the prefill: cuBLAS in both)
                compared += 1
                # 0.1: the logits are bf16, whose spacing is 0.0625 between 8 and 16, and each
                # path's K/V differ in the last bits, more so along the sequence (lease 14: 0.063
                # at the 18th token, one bf16 step, failed the 0.05 this had)
                assert abs(la[i] - lb[i]) < 0.1, (i, la[i], lb[i])
    assert compared > 0 and same >= 0.8 * sum(len(t) for t in tokens_off), (tokens_on, tokens_off)
