"""No Triton compile happens while serving: the engine compiles every kernel variant a step can
need at startup (CUDA graphs for decode, warm_up_kernels for prefill and mixed steps), and the
attention kernels do not specialize on per-step integers (number of sequences, block-table
width). A compile mid-serving stalls every running request for about a second."""

from __future__ import annotations

import json
import random

import pytest

from minivllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

SMALL = {  # Qwen3 features (GQA 16/8, head_dim 128, qk-norm), 4 layers: quick to build
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "attention_bias": False, "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": 151645,
}


def _compiled_variants() -> dict[str, int]:
    from minivllm.kernels import decode_attention, fused_ops, prefill_attention, store_kv
    kernels = {"prefill": prefill_attention._prefill_kernel, "decode": decode_attention._decode_split_kernel,
               "merge": decode_attention._decode_merge_kernel, "store_kv": store_kv._store_kv_kernel,
               "rms_norm": fused_ops._rms_norm_kernel, "rotary": fused_ops._rotary_kernel,
               "silu_and_mul": fused_ops._silu_and_mul_kernel}
    return {name: sum(len(c[0]) for c in k.device_caches.values()) for name, k in kernels.items()}


def test_no_kernel_compiles_after_startup(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(SMALL, f)
    # a small token budget and odd lengths: many mixed steps with changing numbers of sequences,
    # query lengths from 1 to 256 and block tables of changing width
    llm = LLM(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=2048,
              max_num_batched_tokens=256, max_num_seqs=48, gpu_memory_utilization=0.3)
    after_startup = _compiled_variants()
    assert after_startup["prefill"] >= 1 and after_startup["decode"] >= 1
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000) for _ in range(rng.randint(1, 700))]} for _ in range(60)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert _compiled_variants() == after_startup
    llm.llm_engine.shutdown()


def test_startup_leaves_no_large_cached_memory(tmp_path):
    """The engine's warm-up must not keep what its temporaries took: another instance or model
    on the same GPU plans its memory from what is free (lease 8: warming up the LM head on
    1 .. max_num_seqs rows, smallest first, left a prefill instance holding 48 GiB for an
    8 GiB KV cache). With an explicit KV budget, reserved memory stays near allocated memory."""
    import gc

    import torch
    with open(tmp_path / "config.json", "w") as f:
        json.dump(SMALL, f)
    gc.collect()  # an engine an earlier test dropped gives its memory back now, not mid-startup
    torch.cuda.empty_cache()
    cached_before = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    llm = LLM(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=2048,
              max_num_seqs=1024, max_num_batched_tokens=2048, kv_cache_memory_bytes=1 << 30)
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated() - cached_before
    # what stays cached is the CUDA graphs' pool (small steps here); the LM head's largest
    # logits [1024, 151936] alone are 0.3-0.6 GiB, and the smallest-first warm-up kept tens of GiB
    assert cached < 1 << 30, f"{cached / 2**30:.2f} GiB cached after startup"
    llm.llm_engine.shutdown()
