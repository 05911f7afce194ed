"""Multi-LoRA against Hugging Face + PEFT on the default model, fp32 on the CPU: random adapters
made here with `peft` (q/k/v/o/gate/up/down), saved as PEFT directories; minivllm's greedy tokens
must equal HF's with the adapter merged, alone and in one batch mixing adapters and the base."""

from __future__ import annotations

import copy

import pytest
import torch

from minivllm import LLM, LoRARequest, SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["The capital of France is", "Write a list of fruits:", "1, 2, 3, 4,"]
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def make_adapter(hf_model, path, seed: int, rank: int, targets=TARGETS) -> None:
    """A PEFT LoRA adapter with random A and B (B scaled so the model changes but stays fluent-ish)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(r=rank, lora_alpha=2 * rank,
                                                                    target_modules=targets,
                                                                    init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    peft_model.save_pretrained(str(path))


def hf_merged_greedy(hf_model, path, prompts_ids) -> list[list[int]]:
    from peft import PeftModel
    merged = PeftModel.from_pretrained(copy.deepcopy(hf_model), str(path)).merge_and_unload().eval()
    outs = []
    with torch.no_grad():
        for ids in prompts_ids:
            g = merged.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
            outs.append(g[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    paths = []
    for i, (rank, targets) in enumerate([(8, TARGETS), (4, ["q_proj", "v_proj"]), (16, ["o_proj", "down_proj", "up_proj"])]):
        make_adapter(hf_model, root / f"a{i}", seed=i, rank=rank, targets=targets)
        paths.append(root / f"a{i}")
    return paths


@pytest.fixture(scope="module")
def lora_llm():
    return LLM(dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3)


@pytest.fixture(scope="module")
def prompt_ids(lora_llm):
    tok = lora_llm.get_tokenizer()
    return [tok(p)["input_ids"] for p in PROMPTS]


def _run(llm, prompt_ids, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def test_adapter_equals_hf_merged(hf_model, adapters, lora_llm, prompt_ids):
    for i, path in enumerate(adapters[:2]):
        ref = hf_merged_greedy(hf_model, path, prompt_ids)
        got = _run(lora_llm, prompt_ids, LoRARequest(f"a{i}", i + 1, str(path)))
        assert got == ref, f"adapter {i}: minivllm {got} != HF merged {ref}"


def test_mixed_batch_equals_each_alone(adapters, lora_llm, prompt_ids):
    """Three adapters and the base in one batch (max_loras=2: the scheduler holds the third
    adapter's requests until a slot frees) give what each gives alone."""
    loras = [None] + [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    alone = {i: _run(lora_llm, prompt_ids[:1], [lora] * 1)[0] for i, lora in enumerate(loras)}
    assert len({tuple(v) for v in alone.values()}) == 4  # the adapters change the output
    batch_prompts = [prompt_ids[0]] * 8
    batch_loras = [loras[i % 4] for i in range(8)]
    got = _run(lora_llm, batch_prompts, batch_loras)
    for i, g in enumerate(got):
        assert g == alone[i % 4], f"request {i} (adapter {i % 4})"


def test_prefix_cache_keyed_by_adapter(adapters, lora_llm, prompt_ids):
    """A long prompt computed under one adapter is never served to another (or the base) from
    the prefix cache, and is served again to the same adapter."""
    long = prompt_ids[1] * 12  # several full blocks

    def run(lora):
        out = lora_llm.generate([{"prompt_token_ids": long}], GREEDY, use_tqdm=False, lora_request=[lora])[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    a, b = (LoRARequest(f"a{i}", i + 1, str(adapters[i])) for i in (0, 1))
    first, cached_first = run(a)
    _, cached_base = run(None)
    _, cached_b = run(b)
    again, cached_again = run(a)
    assert cached_first == cached_base == cached_b == 0
    assert cached_again >= len(long) - 16 and again == first


@pytest.mark.parametrize("case", ["rank", "missing", "other_model", "disabled"])
def test_bad_adapters_refused(case, adapters, lora_llm, tmp_path, hf_model):
    llm, path = lora_llm, str(adapters[0])
    if case == "rank":
        make_adapter(hf_model, tmp_path / "big", seed=9, rank=32, targets=["q_proj"])
        path, match = str(tmp_path / "big"), "max_lora_rank"
    elif case == "missing":
        path, match = str(tmp_path / "nowhere"), "does not exist"
    elif case == "other_model":
        lora = LoRARequest("x", 77, path, base_model_name="some/other-model")
        with pytest.raises(ValueError, match="base model"):
            llm.generate(["hi"], GREEDY, lora_request=lora, use_tqdm=False)
        return
    else:
        llm, match = LLM(dtype="float32", device="cpu", num_kv_blocks=8), "enable_lora"
    with pytest.raises(ValueError, match=match):
        llm.generate(["hi"], GREEDY, lora_request=LoRARequest("bad", 50, path), use_tqdm=False)
    assert lora_llm.generate(["hi"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving
