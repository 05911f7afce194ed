"""Edge defects of issue 23: logprobs' `bytes` and `text_offset` come from each token's real bytes
(a byte-level token holding part of an emoji or a CJK character decodes to '\\ufffd' alone), and
SamplingParams(allowed_token_ids=[]) is refused instead of meaning "no restriction"."""

from __future__ import annotations

import pytest

from minivllm import SamplingParams
from minivllm.engine.token_bytes import CharOffsets, token_bytes
from minivllm.outputs import Logprob
from minivllm.server.logprobs import chat_logprobs, completion_logprobs

TEXT = "I love pizza 🍕 and 寿司! café"


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def test_token_bytes_rebuild_the_text(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    tb = token_bytes(tok)
    assert b"".join(tb(t) for t in ids) == TEXT.encode("utf-8")
    # the point of it: some tokens hold only part of a character, whose lone decode is U+FFFD
    assert any(tok.decode([t]) == "\ufffd" for t in ids)
    assert tb(tok.eos_token_id) == tok.decode([tok.eos_token_id]).encode() and tb.is_special(tok.eos_token_id)


def test_legacy_logprobs_offsets_point_into_the_text(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    entries = [{t: Logprob(-1.0, 1)} for t in ids]
    lp = completion_logprobs(ids, entries, CharOffsets(), tok)
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(0 <= off < len(TEXT) for off in lp.text_offset)
    # a token's offset counts the characters completed by the bytes before it (a split one once)
    tb = token_bytes(tok)
    for i, off in enumerate(lp.text_offset):
        assert off == len(b"".join(tb(t) for t in ids[:i]).decode("utf-8", errors="ignore"))
    assert TEXT.index("🍕") in lp.text_offset and len(set(lp.text_offset)) < len(ids)  # split characters


def test_chat_logprobs_bytes_are_the_tokens(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    entries = [{t: Logprob(-1.0, 1)} for t in ids]
    content = chat_logprobs(ids, entries, 0, tok)
    assert b"".join(bytes(c.bytes) for c in content) == TEXT.encode("utf-8")
    assert all(c.bytes != list("\ufffd".encode()) for c in content)


def test_empty_allowed_token_ids_refused():
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    assert SamplingParams(allowed_token_ids=[5]).allowed_token_ids == [5]
