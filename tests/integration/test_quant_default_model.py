"""The bundled SmolLM2-135M quantized by the RTN quantizer (quant/export.py) into real checkpoint
files, loaded by minivllm on the CPU: greedy tokens equal those of Hugging Face transformers
running the dequantized weights (fp32), and, for compressed-tensors, those of transformers loading
the very same files through the compressed-tensors library. FP8 weights and an FP8 KV cache:
coherent answers, and the cache holds 4x the tokens of a float32 one in the same bytes."""

from __future__ import annotations

import gc

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.quant import export

NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW)
GROUP = 64  # SmolLM2's 576-wide inputs: 64 divides them, 128 does not


@pytest.fixture(scope="module")
def source(hf_model):
    return export.hf_state_and_config(hf_model)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    import os

    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


@pytest.fixture(scope="module")
def prompts(chat_token_ids) -> list[list[int]]:
    return [chat_token_ids[0], chat_token_ids[3]]  # the capital of France; three prime numbers


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for ids in prompts:
            g = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
            outs.append(g[0, len(ids):].tolist())
    return outs


def _minivllm_greedy(model_dir: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    llm = LLM(model=model_dir, dtype="float32", device="cpu", **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
# AWQ's interleaved packing, and compressed-tensors checked by the library's own unpacking too; every
# format (GPTQ with act-order included) is checked layer by layer in tests/unit/test_quant.py
@pytest.mark.parametrize("fmt", ["awq", "ct-w4a16"])
def test_quantized_checkpoint_greedy_equals_hf_on_dequantized_weights(
        tmp_path, hf_model, source, tokenizer, prompts, fmt: str) -> None:
    state, cfg = source
    q, deq = export.quantized_state(state, fmt, GROUP)
    model_dir = export.write_checkpoint(str(tmp_path / fmt), cfg, q, tokenizer, export.quantization_config(fmt, GROUP))
    del q
    # the session's HF model runs the dequantized weights, then gets its own back (no second copy in memory)
    hf_model.load_state_dict(deq, strict=False)  # a tied lm_head is the embedding, also in deq
    try:
        assert torch.equal(hf_model.model.layers[3].mlp.down_proj.weight, deq["model.layers.3.mlp.down_proj.weight"])
        want = _hf_greedy(hf_model, prompts)
    finally:
        hf_model.load_state_dict(state, strict=False)
    del deq
    gc.collect()
    got = _minivllm_greedy(model_dir, prompts)
    assert got == want
    text = tokenizer.decode(got[0])
    assert "Paris" in text, text  # prompt 0 asks for the capital of France: still coherent at 4 bits
    if fmt == "ct-w4a16":  # (transformers reads symmetric pack-quantized files; asymmetric ones it mis-sizes)
        pytest.importorskip("compressed_tensors")
        from transformers import AutoModelForCausalLM
        hf_ct = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # decompressed by the library
        assert _hf_greedy(hf_ct, prompts) == got


@pytest.mark.slow
def test_fp8_weights_and_fp8_kv_cache_answer_coherently(tokenizer, prompts) -> None:
    from minivllm.quant.fp8 import FP8
    from minivllm.runner.kv_cache import CPU_DEFAULT_KV_BYTES, bytes_per_block
    llm = LLM(dtype="float32", device="cpu", quantization="fp8", kv_cache_dtype="fp8", calculate_kv_scales=True)
    runner = llm.llm_engine.executor.runner
    attn = runner.model.layers[5].self_attn
    assert attn.k_scale.item() == attn.v_scale.item() == 1.0 and attn.calibrate_kv is False
    assert runner.model.layers[0].mlp.down_proj.weight_fp8.dtype == FP8 and runner.kv_caches[0][0].dtype == FP8
    # the CPU's default KV budget holds 4x the blocks it holds in float32 (1 byte per value, not 4)
    per_fp8, per_fp32 = (bytes_per_block(runner.arch, runner.block_size, dt) for dt in (FP8, torch.float32))
    assert per_fp32 == 4 * per_fp8 and llm.llm_engine.block_manager.num_blocks == CPU_DEFAULT_KV_BYTES // per_fp8
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert "Paris" in tokenizer.decode(outs[0].outputs[0].token_ids)
    assert all(len(o.outputs[0].token_ids) > 3 for o in outs)
    # calculate_kv_scales: the first step set every layer's scales from its K and V (none stays 1.0)
    scales = [(layer.self_attn.k_scale.item(), layer.self_attn.v_scale.item()) for layer in runner.model.layers]
    assert all(0 < k != 1.0 and 0 < v != 1.0 for k, v in scales), scales
