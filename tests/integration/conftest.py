"""Shared fixtures: the bundled SmolLM2 model in minivllm and in Hugging Face transformers."""

from __future__ import annotations

import os

import pytest

from minivllm.models.source import default_gguf_path

LONG_TEXT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(40))
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain photosynthesis in one paragraph.",
    "List three prime numbers.",
    "Hi!",
    "Translate 'good morning' to Spanish.",
    "Summarize this text: " + LONG_TEXT,  # over 400 tokens
    "What is 2+2? Answer briefly and then explain how addition works for a child.",
]
MAX_NEW = 32  # also imported by the tests as a fixture value


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return default_gguf_path()


@pytest.fixture(scope="session")
def llm():
    from minivllm import LLM
    return LLM(dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def chat_token_ids(llm) -> list[list[int]]:
    from minivllm.engine.tokenizer import apply_chat_template
    tok = llm.get_tokenizer()
    ids = [apply_chat_template(tok, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    assert max(len(i) for i in ids) > 400 and min(len(i) for i in ids) < 50
    return ids


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                             dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model, chat_token_ids) -> list[list[int]]:
    """HF greedy continuations, one prompt at a time (no padding), eos kept as HF emits it."""
    import torch
    outs = []
    with torch.no_grad():
        for ids in chat_token_ids:
            g = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
            outs.append(g[0, len(ids):].tolist())
    return outs
