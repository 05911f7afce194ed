"""Tokenizer loading (HF directory or GGUF metadata) and prompt formatting."""

from __future__ import annotations

import copy
import functools
import os

from minivllm.config import ModelConfig


def load_tokenizer(cfg: ModelConfig):
    """A transformers fast tokenizer; for GGUF, built from the file's own metadata (vocab,
    merges, special tokens, chat template)."""
    path = cfg.tokenizer or cfg.source_path
    tok = _load_cached(path, os.path.getmtime(path))
    if cfg.chat_template is not None:
        tok = copy.deepcopy(tok)  # the cached one stays as the model ships it
        tok.chat_template = _read_template(cfg.chat_template)
    return tok


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime: float):
    # converting a GGUF vocabulary takes seconds: engines of one process share the result
    from transformers import AutoTokenizer
    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def _read_template(value: str) -> str:
    """--chat-template takes a file path or the Jinja text itself."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None, **kwargs) -> list[int]:
    if not tokenizer.chat_template and chat_template is None:
        raise ValueError("the model has no chat template: pass chat_template (or --chat-template)")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        chat_template=chat_template, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
