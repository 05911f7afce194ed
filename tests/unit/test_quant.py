"""Quantized checkpoints on a tiny random Llama (CPU): every format's loaded layers equal the
dequantized weights the quantizer wrote them from; the packings against their specs; bad
quantization settings; dummy quantized weights; the FP8 reference; an FP8 KV cache."""

from __future__ import annotations

import json
import os

import pytest
import torch

from minivllm.attention.reference import paged_attention_reference, store_kv_reference
from minivllm.engine.config_builder import build_engine_config
from minivllm.models.loader import build_model
from minivllm.attention.backend import get_attention_backend
from minivllm.quant import export, w4
from minivllm.quant.config import resolve_quant_config
from minivllm.quant.fp8 import fp8_linear_reference, quantize_rows

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 192,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
        "vocab_size": 300, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "attention_bias": True, "torch_dtype": "float32"}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, q, kv = 128, 192, 128, 64
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    state = {"model.embed_tokens.weight": torch.randn(300, h, generator=g), "model.norm.weight": torch.ones(h),
             "lm_head.weight": torch.randn(300, h, generator=g) * 0.05}
    for layer in range(2):
        p = f"model.layers.{layer}"
        state[f"{p}.input_layernorm.weight"] = torch.ones(h)
        state[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
        for name, shape in shapes.items():
            mod = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            state[f"{p}.{mod}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.05
            if name in ("q_proj", "k_proj", "v_proj"):
                state[f"{p}.{mod}.{name}.bias"] = torch.randn(shape[0], generator=g) * 0.01
    return state


def write_tiny(tmp_path, fmt: str, group_size: int = 32, quant_cfg: dict | None = None):
    q, deq = export.quantized_state(tiny_state(), fmt, group_size)
    d = export.write_checkpoint(str(tmp_path / fmt), TINY, q, None, quant_cfg or export.quantization_config(fmt, group_size))
    return d, deq


def load(model_dir: str, **kw):
    cfg = build_engine_config(model_dir, device="cpu", dtype="float32", **kw)
    return build_model(cfg.model, get_attention_backend("torch"), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_loaded_layers_equal_the_dequantized_weights(tmp_path, fmt: str) -> None:
    d, deq = write_tiny(tmp_path, fmt)
    model = load(d)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    for layer in range(2):
        mods = {"qkv_proj": model.layers[layer].self_attn.qkv_proj, "o_proj": model.layers[layer].self_attn.o_proj,
                "gate_up_proj": model.layers[layer].mlp.gate_up_proj, "down_proj": model.layers[layer].mlp.down_proj}
        for fused, parts in FUSED.items():
            sub = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
            ref = torch.cat([deq[f"model.layers.{layer}.{sub}.{p}.weight"] for p in parts])
            mod = mods[fused]
            if fmt in ("ct-fp8", "fp8"):  # the layer keeps FP8 weights and quantizes activations per token
                got = mod.weight_fp8.float() * mod.weight_scale_f32[:, None]
            else:  # on the CPU a W4A16 layer becomes an nn.Linear of its dequantized weight
                got = mod.weight
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() <= 1e-6 * ref.abs().max().item(), (fmt, layer, fused)
            if fused == "qkv_proj":  # the q/k/v biases went to their shards
                bias = torch.cat([deq[f"model.layers.{layer}.self_attn.{p}.bias"] for p in parts])
                assert torch.equal(mod.bias.data, bias)
            if fused == "gate_up_proj" and fmt not in ("ct-fp8", "fp8"):
                assert torch.allclose(mod(x), x @ ref.t(), rtol=1e-5, atol=1e-5)


def test_awq_packing_follows_autoawq_order() -> None:
    # AutoAWQ packs each 8 output columns in the order 0 2 4 6 1 3 5 7, column order[i] in bits 4i
    row = torch.arange(8).view(1, 8)
    assert w4.pack_awq(row).item() == 0x75316420
    assert torch.equal(w4.unpack_awq(torch.tensor([[0x75316420]], dtype=torch.int32)), row)
    # GPTQ packs 8 input rows in order, row j in bits 4j
    assert w4.pack_int4(torch.arange(8).view(8, 1), 0).item() == 0x76543210
    vals = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(w4.unpack_awq(w4.pack_awq(vals)), vals)
    assert torch.equal(w4.unpack_int4(w4.pack_int4(vals, 0), 0), vals)


def test_engine_packing_pairs_adjacent_rows() -> None:
    # the engine's words hold rows 0 2 4 6 1 3 5 7 (row ENGINE_ORDER[p] in bits 4p), so the halves of
    # (word >> 4p) & 0x000F000F are the adjacent rows 2p and 2p + 1 (the GEMV's activation pairs)
    word = w4.pack_engine(torch.arange(8).view(8, 1)).item()
    assert word == 0x75316420
    for p in range(4):
        pair = (word >> (4 * p)) & 0x000F000F
        assert (pair & 0xF, pair >> 16) == (2 * p, 2 * p + 1)
    vals = torch.randint(0, 16, (32, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(w4.unpack_engine(w4.pack_engine(vals)), vals)
    assert not torch.equal(w4.pack_engine(vals), w4.pack_int4(vals, 0))  # not GPTQ's in-order words


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_interleaved_scales_and_zeros_are_views_of_one_pair_tensor(dtype) -> None:
    """The GPU loader's layout (w4.interleave_scale_zero): the same values, each 16-bit scale and
    its zero the low and high halves of one 32-bit word, which the GEMV's pair check recognises;
    other dtypes (float32: the CPU keeps dense weights anyway) come back as they were."""
    from minivllm.kernels.w4a16_gemm import scale_zero_pairs
    g = torch.Generator().manual_seed(0)
    scales = (torch.rand(3, 40, generator=g) + 0.01).to(dtype)
    zeros = torch.randint(0, 16, (3, 40), generator=g).to(dtype)
    s, z = w4.interleave_scale_zero(scales, zeros)
    assert torch.equal(s, scales) and torch.equal(z, zeros)
    if dtype == torch.float32:
        assert s is scales and z is zeros and not scale_zero_pairs(s, z)
        return
    assert scale_zero_pairs(s, z) and not scale_zero_pairs(scales, zeros)
    words = s.untyped_storage()
    pairs = torch.empty(0, dtype=torch.int32).set_(words, 0, (3, 40), (40, 1))  # one int32 per column
    assert torch.equal((pairs & 0xFFFF).to(torch.int16), scales.view(torch.int16))
    assert torch.equal((pairs >> 16).to(torch.int16), zeros.view(torch.int16))


def test_compressed_tensors_packing_is_ours() -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = torch.randint(-8, 8, (6, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    packed = helpers.pack_to_int32(q.to(torch.int8), 4)
    assert torch.equal(w4.unpack_int4(packed, 1), q + 8)
    packed0 = helpers.pack_to_int32(q.t().contiguous().to(torch.int8), 4, packed_dim=0)  # zero points: along N
    assert torch.equal(w4.unpack_int4(packed0, 0), q.t() + 8)
    # the exporter's fallback where the library is absent packs the same words
    assert torch.equal(w4.pack_int4(q + 8, 1), packed) and torch.equal(w4.pack_int4(q.t() + 8, 0), packed0)


def test_act_order_layout_and_reference_product() -> None:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(3))
    r = export.rtn_w4(w, 32, sym=False, col_norms=w.norm(dim=0))
    perm = w4.group_perm(r.g_idx, 32, 128)
    assert perm is not None and torch.equal(r.g_idx[perm], torch.arange(128) // 32)
    qweight = w4.pack_engine(r.q.t()[perm])
    g = torch.arange(4)
    zeros, scales = r.zeros.t()[g].float(), r.scales.t()[g].float()
    assert torch.allclose(w4.dequantize(qweight, scales, zeros, 32, perm), r.dequantize(), atol=1e-6)
    x = torch.randn(3, 128)
    assert torch.allclose(w4.w4a16_reference(x, qweight, scales, zeros, 32, perm), x @ r.dequantize().t(), atol=1e-4)


def test_fp8_reference_quantizes_activations_per_token() -> None:
    # (a row whose max is below 448 * MIN_SCALE = 1/512 keeps MIN_SCALE, and so stays below 448)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1.0], [100.0], [0.0], [1e-2]])
    x_q, s = quantize_rows(x)
    assert x_q.dtype == torch.float8_e4m3fn and s.shape == (4, 1)
    assert x_q.float().abs().amax(1)[[0, 1, 3]].eq(448).all() and x_q[2].float().eq(0).all()
    assert torch.isfinite(quantize_rows(torch.tensor([[1e6, -1e6, 1.0]]))[0].float()).all()
    w = torch.randn(32, 64) * 0.1
    w_q, w_s = quantize_rows(w)
    y = fp8_linear_reference(x, w_q, w_s.view(-1))
    exact = (x_q.float() * s) @ (w_q.float() * w_s).t()
    assert torch.allclose(y, exact, rtol=1e-5, atol=1e-6)
    assert ((y - x @ w.t()).norm() / (x @ w.t()).norm()).item() < 0.05


@pytest.mark.parametrize("qc, forced, setting", [
    ({"quant_method": "bitsandbytes"}, None, "quant_method"),
    ({"quant_method": "awq", "bits": 4, "group_size": 48}, None, "group_size"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, None, "bits"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, "weight_block_size"),
    (None, "awq", "quantization"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "awq", "quantization"),
    (None, "int8", "quantization"),
])
def test_bad_quantization_settings_name_model_and_setting(qc, forced, setting) -> None:
    with pytest.raises(ValueError) as e:
        resolve_quant_config(qc, forced, "my-model")
    assert "my-model" in str(e.value) and setting in str(e.value)


def test_group_size_that_does_not_divide_the_layer_is_refused(tmp_path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(TINY, hidden_size=96, head_dim=24,
                                                   quantization_config=export.quantization_config("awq", 64))))
    with pytest.raises(ValueError, match="model .m.*q_proj.*group_size 64"):
        load(str(d), load_format="dummy")


def test_kv_cache_dtype_is_validated() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        build_engine_config(device="cpu", kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("bad", [None, "0.9", True, 0.0, 1.5])
def test_gpu_memory_utilization_is_validated(bad) -> None:
    """A clear error naming the field (None and strings raised a TypeError from a comparison)."""
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        build_engine_config(device="cpu", gpu_memory_utilization=bad)


@pytest.mark.parametrize("fmt", ["awq", "gptq-act", "ct-w4a16-asym", "ct-fp8"])
def test_dummy_weights_with_a_quantization_config(tmp_path, fmt: str) -> None:
    d = tmp_path / fmt
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(TINY, quantization_config=export.quantization_config(fmt, 32))))
    model = load(str(d), load_format="dummy")
    w = model.layers[0].mlp.down_proj
    deq = w.weight if isinstance(w, torch.nn.Linear) else w.weight_fp8.float() * w.weight_scale_f32[:, None]
    assert torch.isfinite(deq).all() and 0 < deq.abs().max() <= 0.0201  # as the dummy bf16 weights' +-0.02


def _paged_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    num_blocks, bs, hk, d = 16, 8, 2, 32
    seq_lens, q_lens = [20, 7, 33], [20, 1, 5]
    tables = torch.randperm(num_blocks, generator=g)[:15].view(3, 5).to(torch.int32)
    keys = torch.randn(sum(seq_lens), hk, d, generator=g) * 3
    vals = torch.randn(sum(seq_lens), hk, d, generator=g)
    slots = torch.cat([tables[i].long().repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
                       for i, n in enumerate(seq_lens)])
    q = torch.randn(sum(q_lens), 4, d, generator=g)
    return num_blocks, bs, hk, d, seq_lens, q_lens, tables, keys, vals, slots, q


def test_fp8_kv_attention_is_close_to_full_precision_kv() -> None:
    num_blocks, bs, hk, d, seq_lens, q_lens, tables, keys, vals, slots, q = _paged_case(0)
    qsl = [0, 20, 21, 26]
    out = {}
    for dtype, scale in ((torch.float32, None), (torch.float8_e4m3fn, torch.tensor([0.05]))):
        k_cache = torch.zeros(num_blocks, bs, hk, d, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        store_kv_reference(keys, vals, k_cache, v_cache, slots, scale, scale)
        ref = paged_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, d ** -0.5, scale, scale)
        # the CPU backend (SDPA paths) reads the same FP8 blocks as the reference
        from minivllm.attention.metadata import AttentionMetadata
        new_slots = torch.cat([slots[sum(seq_lens[:i]) + s - n: sum(seq_lens[:i]) + s]
                               for i, (s, n) in enumerate(zip(seq_lens, q_lens))])
        meta = AttentionMetadata(new_slots, torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                                 tables, max(q_lens), max(seq_lens), qsl, seq_lens)
        got = get_attention_backend("torch").attend(q, k_cache, v_cache, meta, d ** -0.5, scale, scale)
        assert torch.allclose(got, ref, atol=1e-5), dtype
        out[dtype] = ref
    rel = ((out[torch.float8_e4m3fn] - out[torch.float32]).norm() / out[torch.float32].norm()).item()
    assert 1e-4 < rel < 0.05, rel  # e4m3 keeps ~3 significant bits: a few percent, never exact


def test_calibrated_kv_scales_put_the_step_maximum_at_the_range() -> None:
    from minivllm.models.layers import K_SCALE_RANGE, V_SCALE_RANGE, calibrate_kv_scales

    class Attn:
        k_scale, v_scale, calibrate_kv = torch.ones(1), torch.ones(1), True

    attn = Attn()
    k, v = torch.randn(7, 2, 16) * 30, torch.randn(7, 2, 16) * 0.1
    calibrate_kv_scales(attn, k, v)
    assert attn.calibrate_kv is False
    assert torch.allclose(k.abs().max() / attn.k_scale, torch.tensor(K_SCALE_RANGE))
    assert torch.allclose(v.abs().max() / attn.v_scale, torch.tensor(V_SCALE_RANGE))


def test_fused_fp8_activation_quant_keeps_the_tokens(tmp_path) -> None:
    """The norms and SwiGLUs that quantize for their FP8 linear (kernels/fp8_act.py, wired in at
    load time on the GPU) give the same greedy tokens and logprobs as the separate quantizer: here
    with their torch stand-ins on the CPU (bf16, so the decoder layers' own forward runs), which
    is the plumbing the GPU path shares: Fp8Rows through RMSNorm, Attention, MLP and the linear."""
    pytest.importorskip("triton")
    from minivllm import LLM, SamplingParams
    from minivllm.kernels import fp8_act
    from minivllm.models.layers import MLP, RMSNorm
    d, _ = write_tiny(tmp_path, "ct-fp8")
    llm = LLM(model=d, skip_tokenizer_init=True, device="cpu", dtype="bfloat16", kv_cache_memory_bytes=4 << 20)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250, 42, 7]}, {"prompt_token_ids": [1, 2, 3]}]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)

    def run():
        return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params, use_tqdm=False)]
    plain = run()
    model = llm.llm_engine.executor.runner.model
    assert fp8_act.enable_fused_activation_quant(model.layers, on_cpu=True) == 3 * len(model.layers)
    calls = {"norm": 0, "silu": 0}
    norm_fp8, silu_fp8 = fp8_act.rms_norm_fp8, fp8_act.silu_and_mul_fp8

    def counted(kind, fn):
        def wrapped(*a, **k):
            calls[kind] += 1
            return fn(*a, **k)
        return wrapped
    fp8_act.rms_norm_fp8, fp8_act.silu_and_mul_fp8 = counted("norm", norm_fp8), counted("silu", silu_fp8)
    try:
        fused = run()
    finally:
        fp8_act.rms_norm_fp8, fp8_act.silu_and_mul_fp8 = norm_fp8, silu_fp8
    assert calls["norm"] > 0 and calls["silu"] > 0, calls
    assert all(m.fp8_out for m in model.modules() if isinstance(m, RMSNorm) and m is not model.norm)
    assert all(m.fp8_act for m in model.modules() if isinstance(m, MLP))
    assert fused == plain
    llm.llm_engine.shutdown()


def test_w4a16_gemv_table_is_well_formed_and_cpu_keeps_the_default() -> None:
    """The kept GEMV launches (kernels/configs/w4a16_gemv/) name tiles the kernel takes and a
    split that leaves every program a K slice; the CPU never reads them."""
    from pathlib import Path

    from minivllm.kernels import w4a16_gemm as w4k
    tables = list(Path(w4k.GEMV_CONFIG_DIR).glob("*.json"))
    assert tables, "no kept GEMV table"
    for path in tables:
        for key, entry in json.loads(path.read_text()).items():
            n, k, g = (int(part.split("=")[1]) for part in key.split(","))
            block_n, block_k, warps, stages = entry["tile"]
            assert block_n & (block_n - 1) == 0 and 16 <= block_n <= 512, key
            assert block_k % g == 0 or g % block_k == 0, key  # a K step holds whole groups, or a group whole steps
            assert block_k % 8 == 0 and warps in (2, 4, 8) and 1 <= stages <= 5, key
            assert 1 <= entry["split_k"] <= min(w4k.MAX_SPLIT_K, k // block_k), key
    cfg, split = w4k.gemv_launch(4096, 4096, 128, torch.device("cpu"))
    assert cfg == w4k.w4a16_config(1) and split is None
