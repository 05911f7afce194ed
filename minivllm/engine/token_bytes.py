"""The exact bytes of one token, for logprobs' `bytes` and `text_offset`.

Decoding one token on its own gives '\ufffd' for a fragment of a multi-byte character (a byte-level
BPE token holding half an emoji or a CJK character), so the decoded string's UTF-8 is not the
token's bytes. The bytes come from the vocabulary entry instead:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): every byte is spelled by one printable character
  (`bytes_to_unicode`, the table the tokenizer itself uses); the entry maps back byte for byte;
- SentencePiece with byte fallback (Llama 2, Mistral): `<0xE2>` is the byte 0xE2, `▁` a space;
- anything else (special tokens, other vocabularies): the decoded text's UTF-8.
"""

from __future__ import annotations

import codecs
import json
import re
import weakref

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class TokenBytes:
    """token id -> bytes for one tokenizer (cached per id)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.kind = _vocab_kind(tokenizer)
        self._byte_decoder: dict[str, int] = {}
        if self.kind == "byte_level":
            from transformers.convert_slow_tokenizer import bytes_to_unicode
            self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._compute(token_id)
        return b

    def is_special(self, token_id: int) -> bool:
        """Special tokens (eos, chat markers) are left out of output text (skip_special_tokens)."""
        return token_id in self._special

    def _compute(self, token_id: int) -> bytes:
        tok = self.tokenizer
        piece = tok.convert_ids_to_tokens(token_id)
        if piece is None:  # an id past the tokenizer's vocabulary (padded model vocab)
            return b""
        if token_id not in self._special:
            if self.kind == "byte_level" and all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            if self.kind == "sentencepiece":
                m = _BYTE_FALLBACK.match(piece)
                if m:
                    return bytes([int(m.group(1), 16)])
                return piece.replace("\u2581", " ").encode("utf-8")
        return tok.convert_tokens_to_string([piece]).encode("utf-8")


def token_bytes(tokenizer) -> TokenBytes:
    """The (cached) TokenBytes of a tokenizer."""
    table = _tables.get(tokenizer)
    if table is None:
        table = _tables[tokenizer] = TokenBytes(tokenizer)
    return table


def _vocab_kind(tokenizer) -> str:
    """'byte_level', 'sentencepiece' (Metaspace with byte fallback tokens) or 'other'."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "other"
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - an exotic backend: fall back to the decoded text
        return "other"
    decoders = _decoder_types(spec.get("decoder"))
    if "ByteLevel" in decoders:
        return "byte_level"
    if (spec.get("model") or {}).get("byte_fallback") or "ByteFallback" in decoders:
        return "sentencepiece"
    return "other"


def _decoder_types(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return {d.get("type") for d in decoder.get("decoders", [])}
    return {decoder.get("type")}


class CharOffsets:
    """Character offsets of consecutive tokens in the text they decode to: the offset of a token is
    the number of characters completed by the bytes of the tokens before it (a character split
    over tokens counts once, when its last byte arrives), so every offset points into the text."""

    def __init__(self, start: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = start

    def advance(self, data: bytes) -> int:
        """The offset before `data`; then moves past it."""
        before = self.offset
        self.offset += len(self._decoder.decode(data))
        return before
