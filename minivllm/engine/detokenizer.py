"""Incremental detokenization and stop strings for one generated sequence.

Each step decodes only a small window of output token ids, never the whole output:

    output ids:  ... already emitted ... | t_p ... t_r-1 | t_r ... t_n-1
                                         ^ window[0]     ^ window[read]
                                         '-- context ---''-- pending ---'

- context: the ids of the last emitted chunk. They are decoded again together with the
  pending ids so that the decoder sees the boundary (leading-space rules, byte merges);
  `prefix_text = decode(context)` and only the text after it is new.
- pending: ids whose text is not stable yet: the decoded window ends with U+FFFD (an
  incomplete UTF-8 sequence that a later byte may complete) or, for byte-fallback
  tokenizers, the ids end with an open run of <0xNN> tokens (the ByteFallback decoder turns
  a whole run into one U+FFFD per byte when it is not valid UTF-8, so a later byte token can
  rewrite text from earlier ones).
- Once the pending text is stable it is appended to `output_text`, the pending ids become
  the new context and older ids are dropped: the window stays a few tokens long (a run of
  byte-fallback tokens is held whole until it closes).
- When the sequence finishes, pending text is flushed as it is (a trailing U+FFFD included).

Invariant: the text emitted over the whole stream (after the final flush) is
`tokenizer.decode(output_ids, skip_special_tokens=...)`, i.e. the output decoded on its own,
as Hugging Face decodes a generation (for SmolLM2's byte-level BPE that is also the text the
output has in the context of the prompt). Stop strings may then cut it short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from minivllm.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
# Pending ids beyond this many make a no-progress step drop skipped special tokens.
_PRUNE_AFTER = 8


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, token by token.

    `update()` appends tokens, extends `output_text` and checks stop strings;
    `get_next_output_text()` hands the text to a (streaming) client, holding back the tail
    that could still turn out to be the start of a stop string. Per engine step:

        stop = detok.update(new_ids, stop_terminated=eos_or_stop_id, finished=at_max_tokens)
        text = detok.get_next_output_text(finished=request_finished, delta=True)
    """

    __slots__ = (
        "_backend", "_skip_special", "_byte_fallback", "_special_ids",
        "_stop", "_include_stop", "_min_tokens", "_max_stop_len", "_hold_back",
        "_window", "_read", "_prefix_text", "_open_byte_run",
        "_pieces", "_text_len", "_stop_tail", "_num_tokens", "_sent", "_done",
        "num_prompt_tokens", "stop_string",
    )

    def __init__(self, tokenizer: PreTrainedTokenizerFast, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        # The Rust tokenizer: decoding through it skips transformers' per-call overhead.
        self._backend = tokenizer.backend_tokenizer
        self._skip_special = params.skip_special_tokens
        # spaces_between_special_tokens is not applied: transformers' fast tokenizers ignore it
        # too, and byte-level BPE decoders never insert spaces between added tokens.
        self._byte_fallback = "ByteFallback" in repr(self._backend.decoder)
        self._special_ids: frozenset[int] | None = None  # built lazily, only if needed
        self._stop = list(params.stop_strings)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        # A client must never see the start of a stop string that later gets cut.
        self._hold_back = 0 if self._include_stop else max(self._max_stop_len - 1, 0)
        # The output is decoded on its own (see the module docstring); the prompt only counts.
        self.num_prompt_tokens = len(prompt_token_ids)

        self._window: list[int] = []  # context ids + pending ids
        self._read = 0  # window[:_read] is context, window[_read:] is pending
        self._prefix_text = ""  # decode(window[:_read])
        self._open_byte_run = False  # pending ids end with an unterminated <0xNN> run
        # The output text is kept as pieces (joined on demand): appending to one growing
        # str would copy the whole text on every token.
        self._pieces: list[str] = []
        self._text_len = 0  # sum(len(p) for p in _pieces)
        self._stop_tail = ""  # the last (max_stop_len - 1) chars already searched for stops
        self._num_tokens = 0  # output tokens seen by update(), a stop token included
        self._sent = 0  # text[:_sent] was returned by get_next_output_text(delta=True)
        self._done = False  # a stop string matched or the final flush ran
        self.stop_string: str | None = None  # the stop string that ended the sequence

    # ------------------------------------------------------------------ public API

    @property
    def output_text(self) -> str:
        """All text so far (cut at a matched stop string). O(length): not for every step."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def update(self, new_token_ids: list[int], stop_terminated: bool = False,
               finished: bool = False) -> str | None:
        """Append newly generated tokens; return the stop string that matched, or None.

        On a match `output_text` is cut before the stop string (after it with
        include_stop_str_in_output) and text after the stop string is discarded; later
        calls do nothing. `stop_terminated`: the last id is a stop token (EOS or one of
        stop_token_ids); like vLLM, its text is left out unless include_stop_str_in_output.
        `finished` (implied by stop_terminated): these are the last tokens (e.g. max_tokens),
        so text still pending (an unfinished UTF-8 sequence) is flushed now and a stop
        string in it is reported here rather than by get_next_output_text().
        """
        if self._done:
            return None
        skip_last = stop_terminated and not self._include_stop and bool(new_token_ids)
        stop = self._check_stop(self._extend(new_token_ids[:-1] if skip_last else new_token_ids))
        self._num_tokens += skip_last
        if stop is None and (finished or stop_terminated):
            stop = self._flush()
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for the client: new since the last delta call (delta) or all so far.

        While not finished, the last (max stop length - 1) characters are held back when
        stop strings are set (and not included in the output). On finish the pending
        undecodable tail is flushed (as `tokenizer.decode` would render it; a stop string
        found in it only sets `stop_string`) and all the (truncated) text is released.
        """
        if finished:
            self._flush()
        end = self._text_len if finished else self._text_len - self._hold_back
        if not delta:
            return self.output_text[:max(end, 0)]
        if end <= self._sent:
            return ""
        # Only the unsent tail is touched: O(new text + hold-back) per call.
        text = self._suffix(self._text_len - self._sent)[:end - self._sent]
        self._sent = end
        return text

    # ------------------------------------------------------------------ decoding

    def _extend(self, token_ids: list[int]) -> str:
        """Decode ids into the text; return the new text that may complete a stop string."""
        searchable: list[str] = []
        for tid in token_ids:
            piece = self._decode_next(tid)
            self._num_tokens += 1
            if not piece:
                continue
            self._append(piece)
            if self._num_tokens <= self._min_tokens:
                self._remember_searched(piece)  # min_tokens: no stop string may end here
            else:
                searchable.append(piece)
        return "".join(searchable)

    def _decode_next(self, tid: int) -> str:
        """Append one id to the window; return the newly stable text (maybe "")."""
        self._window.append(tid)
        if self._byte_fallback:
            self._track_byte_run(tid)
            if self._open_byte_run:
                self._prune_pending()
                return ""
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            self._prune_pending()
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        """Emit text past the context; the pending ids become the new context."""
        # For the decoders we know (byte-level, Metaspace/ByteFallback/Strip) the context's
        # text is a prefix of the window's text, because emission only happens at stable
        # boundaries. Should an exotic decoder break that, slice by length (as vLLM does)
        # rather than stall.
        delta = text[len(self._prefix_text):]
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    def _prune_pending(self) -> None:
        """Drop skipped special tokens from a long pending run.

        They never reach the decoder, so dropping them changes no text; without this a
        stream of EOS tokens (ignore_eos) would grow the window and the cost per token.
        """
        if self._skip_special and len(self._window) - self._read > _PRUNE_AFTER:
            skipped = self._skipped_ids()
            self._window[self._read:] = [i for i in self._window[self._read:] if i not in skipped]

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special)

    def _track_byte_run(self, tid: int) -> None:
        token = self._backend.id_to_token(tid)
        if token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            self._open_byte_run = True
        elif not (self._skip_special and tid in self._skipped_ids()):
            # A skipped special token vanishes before the decoder: the runs on its two sides
            # join, so it does not end the run. Any other token does.
            self._open_byte_run = False

    def _skipped_ids(self) -> frozenset[int]:
        if self._special_ids is None:
            added = self._backend.get_added_tokens_decoder()
            self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        return self._special_ids

    def _flush(self) -> str | None:
        """At the end of the sequence, emit pending text even if it ends with U+FFFD."""
        if self._done:
            return None
        piece = ""
        if self._read < len(self._window):
            text = self._decode(self._window)
            if len(text) > len(self._prefix_text):
                piece = self._advance(text)
                self._append(piece)
        stop = self._check_stop(piece) if self._num_tokens > self._min_tokens else None
        self._done = True
        return stop

    # ------------------------------------------------------------------ text pieces

    def _append(self, piece: str) -> None:
        self._pieces.append(piece)
        self._text_len += len(piece)

    def _suffix(self, n: int) -> str:
        """The last n characters of the text, touching only the pieces that hold them."""
        parts: list[str] = []
        size = 0
        for piece in reversed(self._pieces):
            if size >= n:
                break
            parts.append(piece)
            size += len(piece)
        text = "".join(reversed(parts))
        return text[len(text) - n:]

    def _truncate(self, length: int) -> None:
        # The hold-back guarantees a cut never reaches text a client has already seen.
        assert length >= self._sent, (length, self._sent)
        excess = self._text_len - length
        while excess > 0:
            last = self._pieces.pop()
            if len(last) > excess:
                self._pieces.append(last[:len(last) - excess])
                break
            excess -= len(last)
        self._text_len = length

    # ------------------------------------------------------------------ stop strings

    def _remember_searched(self, text: str) -> None:
        """Keep the last (max_stop_len - 1) searched chars: a stop string may start there."""
        if self._stop:
            tail = self._stop_tail + text
            self._stop_tail = tail[max(len(tail) - self._max_stop_len + 1, 0):]

    def _check_stop(self, new_text: str) -> str | None:
        """Search new_text (the end of the text) for stop strings, preceded by the tail."""
        if not self._stop or not new_text:
            return None
        # region == text[-len(region):]: the searched tail, then the new text.
        region = self._stop_tail + new_text
        match = find_stop_string(region, len(self._stop_tail), self._stop)
        if match is None:
            self._remember_searched(new_text)
            return None
        index, stop = match
        cut = index + len(stop) if self._include_stop else index
        self._truncate(self._text_len - len(region) + cut)
        self.stop_string = stop
        self._done = True
        return stop


def find_stop_string(text: str, checked: int, stop_strings: list[str]) -> tuple[int, str] | None:
    """Earliest occurrence of a stop string that ends after text[:checked].

    Searching each stop string from `checked - (len - 1)` covers matches that straddle the
    old/new boundary while never re-scanning old text. The earliest start wins; on a tie the
    stop string listed first wins.
    """
    best: tuple[int, str] | None = None
    for stop in stop_strings:
        index = text.find(stop, max(checked - len(stop) + 1, 0))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def decode_logprob_tokens(tokenizer: PreTrainedTokenizerFast, token_ids: list[int]) -> list[str]:
    """Displayable text of each token on its own, for logprobs output (as vLLM does).

    Ids the tokenizer does not know (a model vocabulary padded past the tokenizer's) give "".
    """
    tokens = tokenizer.convert_ids_to_tokens(token_ids)
    return ["" if tok is None else tokenizer.convert_tokens_to_string([tok]) for tok in tokens]
