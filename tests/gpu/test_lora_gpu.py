"""Multi-LoRA's Triton segmented kernel (kernels/lora_sgmv.py) against the per-adapter torch
reference (lora/ops.py), and the engine's LoRA and beam search on the GPU.

`check_lora_delta` is device-agnostic and returns failure strings (empty = pass):
tests/unit/test_lora_interpret.py runs it on the CPU under TRITON_INTERPRET=1, the tests here on
a CUDA GPU with a real model's shapes (Qwen3-8B-like widths, rank 16, bf16)."""

from __future__ import annotations

import pytest
import torch

from minivllm.lora.ops import lora_delta_reference, lora_delta_triton, slot_segments


def check_lora_delta(tokens: int, d_in: int, d_out: int, rank: int, slots: int, dtype: torch.dtype, device: str,
                     seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=g).to(dtype)
    a = (torch.randn(slots, rank, d_in, generator=g) / d_in ** 0.5).to(dtype)
    b = (torch.randn(slots, d_out, rank, generator=g) / rank ** 0.5).to(dtype)
    slot_of = torch.randint(-1, slots, (tokens,), generator=g)  # -1: the base model
    slot_of[0] = -1
    y0 = torch.randn(tokens, d_out, generator=g).to(dtype)
    groups = [(s, (slot_of == s).nonzero().flatten()) for s in range(slots) if (slot_of == s).any()]
    want = lora_delta_reference(x.float(), y0.float().clone(), a.float(), b.float(), groups)
    # the runner's buffers are longer than the step (graph padding): a stale tail must not matter
    order, start, count = slot_segments(slot_of, slots)
    order = torch.cat([order, torch.full((5,), 10 ** 6, dtype=torch.int32)])
    segments = tuple(t.to(device) for t in (order, start, count))
    got = lora_delta_triton(x.to(device), y0.to(device).clone(), a.to(device), b.to(device), segments)
    got = got.float().cpu()
    fails = []
    base_rows = slot_of < 0
    if not torch.equal(got[base_rows], y0[base_rows].float()):
        fails.append("a base-model row changed")
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
    if err > tol:
        fails.append(f"relative error {err:.2e} > {tol}")
    return fails


pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.parametrize("tokens,d_in,d_out,rank", [(1, 4096, 6144, 48), (256, 4096, 4096, 16), (777, 4096, 24576, 32),
                                                     (3, 12288, 4096, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_kernel_matches_reference(tokens, d_in, d_out, rank, dtype):
    assert check_lora_delta(tokens, d_in, d_out, rank, 4, dtype, "cuda", seed=tokens + rank) == []


def write_random_adapter(path, arch, seed: int, rank: int) -> str:
    """A random PEFT-layout adapter (adapter_config.json + adapter_model.safetensors) on every
    q/k/v/o/gate/up/down of the model, written directly (no peft needed on the GPU machine)."""
    import json

    from safetensors.torch import save_file

    from minivllm.lora.adapter import MODULES, module_dims
    g = torch.Generator().manual_seed(seed)
    dims, tensors = module_dims(arch), {}
    for layer in range(arch.num_layers):
        for mod in MODULES:
            d_in, d_out = dims[mod]
            part = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{mod}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.05
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": list(MODULES)}))
    return str(path)


def test_lora_engine_gpu_equals_cpu_reference(tmp_path):
    """The same random adapters on the GPU (Triton kernels, CUDA graphs) and on the CPU (torch
    reference), fp32, a batch mixing three adapters and the base: greedy tokens equal."""
    from minivllm import LLM, LoRARequest, SamplingParams
    prompts = ["The capital of France is", "1, 2, 3,", "def main():", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results, loras = {}, None
    for device in ("cpu", "cuda"):
        llm = LLM(dtype="float32", device=device, enable_lora=True, max_loras=4, max_lora_rank=8)
        if loras is None:
            arch = llm.llm_engine.config.model.arch
            loras = [None] + [LoRARequest(f"a{i}", i + 1, write_random_adapter(tmp_path / f"a{i}", arch, i, 8))
                              for i in range(3)]
        outs = llm.generate(prompts * 2, params, lora_request=loras * 2, use_tqdm=False)
        results[device] = [o.outputs[0].token_ids for o in outs]
        del llm
    assert results["cuda"] == results["cpu"]
    assert len({tuple(t) for t in results["cpu"][:4]}) == 4  # the adapters change the output


def test_beam_search_gpu_smoke():
    from minivllm import LLM, BeamSearchParams
    llm = LLM(dtype="float32", device="cuda", kv_cache_memory_bytes=1 << 30)  # earlier tests hold GPU memory
    cpu = LLM(dtype="float32", device="cpu")
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    got = [[s.tokens for s in o.sequences] for o in llm.beam_search(prompts, params)]
    want = [[s.tokens for s in o.sequences] for o in cpu.beam_search(prompts, params)]
    assert got == want
