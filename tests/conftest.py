import os

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A factory: the path of a tiny random Llama saved with transformers (safetensors, no
    tokenizer), by its LlamaConfig overrides; the default has 4 heads, 2 KV heads, 4 layers."""
    made: dict[tuple, str] = {}

    def make(**overrides) -> str:
        key = tuple(sorted(overrides.items()))
        if key not in made:
            import torch
            from transformers import LlamaConfig, LlamaForCausalLM
            kw = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp("tiny_llama")
            LlamaForCausalLM(LlamaConfig(**{**kw, **overrides})).save_pretrained(path)
            made[key] = str(path)
        return made[key]

    return make
