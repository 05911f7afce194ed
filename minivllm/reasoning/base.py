"""The reasoning parser interface: markers, whole-text split, streamed split, and the token-level
facts the engine needs (where reasoning ends)."""

from __future__ import annotations

from dataclasses import dataclass, field


class ReasoningParser:
    """A `<think>...</think>` splitter. `implicit_start`: the prompt's template opens the
    reasoning section, so output is reasoning until the end marker even without a start marker
    (DeepSeek-R1); otherwise output is reasoning only if it opens with the start marker."""

    name = "base"
    start = "<think>"
    end = "</think>"
    implicit_start = False

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None where a part is empty."""
        body, opened = _strip_start(text, self.start)
        head, sep, tail = body.partition(self.end)
        if sep:
            return head or None, tail or None
        if opened or self.implicit_start:  # still thinking when the output stopped
            return head or None, None
        return None, text or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    # ---- engine side ---------------------------------------------------------------------------
    def marker_ids(self, tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(start, end) markers as token ids (one token each for Qwen3 and DeepSeek-R1)."""
        return (tuple(tokenizer.encode(self.start, add_special_tokens=False)),
                tuple(tokenizer.encode(self.end, add_special_tokens=False)))

    @staticmethod
    def ended_in_prompt(prompt_ids: list[int], start_ids: tuple[int, ...], end_ids: tuple[int, ...]) -> bool:
        """The template opened and closed the reasoning section (thinking turned off), so the
        constraint applies from the first output token."""
        last_start, last_end = _rfind(prompt_ids, start_ids), _rfind(prompt_ids, end_ids)
        return last_start >= 0 and last_end > last_start


@dataclass
class ReasoningStream:
    """Splits streamed text deltas: feed() returns (reasoning delta, content delta). Text that
    may be the start of a marker is held back until the next delta (or finish()). Without
    implicit_start, output that does not open with the start marker streams as content even if
    an end marker comes later (split() of the whole text would cut there)."""

    parser: ReasoningParser
    mode: str = "start"  # start (deciding) | reasoning | content
    held: str = field(default="")

    def feed(self, delta: str) -> tuple[str, str]:
        text = self.held + delta
        self.held = ""
        if self.mode == "start":
            text = self._open(text)
            if self.mode == "start":
                return "", ""
        if self.mode == "content":
            return "", text
        head, sep, tail = text.partition(self.parser.end)
        if sep:
            self.mode = "content"
            return head, tail
        keep = _marker_prefix_len(text, self.parser.end)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], ""

    def _open(self, text: str) -> str:
        stripped = text.lstrip()
        p = self.parser
        if stripped.startswith(p.start):
            self.mode = "reasoning"
            return stripped[len(p.start):]
        if p.start.startswith(stripped):  # maybe the start marker, not complete yet
            self.held = text
            return ""
        self.mode = "reasoning" if p.implicit_start else "content"
        return text

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        text, self.held = self.held, ""
        if self.mode == "reasoning" or (self.mode == "start" and self.parser.implicit_start):
            return text, ""
        return "", text


def _strip_start(text: str, start: str) -> tuple[str, bool]:
    stripped = text.lstrip()
    if stripped.startswith(start):
        return stripped[len(start):], True
    return text, False


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _rfind(seq: list[int], sub: tuple[int, ...]) -> int:
    n = len(sub)
    if n == 0:
        return -1
    for i in range(len(seq) - n, -1, -1):
        if tuple(seq[i:i + n]) == sub:
            return i
    return -1
