"""Aligning tokens and characters.

The text of a row is ``tokenizer.decode(row)``. A token has no text of its own (byte-level BPE
splits UTF-8 characters across tokens, SentencePiece drops the first leading space), so every
function here works with decoded *prefixes*: token ``k`` ends at ``len(decode(ids[:k + 1]))``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["longest_token_prefix", "token_char_spans", "Detokenizer"]

_WINDOW = 8  # tokens of left context enough to decode any single character correctly


def longest_token_prefix(tokenizer, ids: Sequence[int], text: str) -> tuple[int, int]:
    """The largest ``k`` with ``decode(ids[:k])`` a prefix of ``text``, and that prefix's length.

    Decoded lengths are not monotonic (an incomplete character decodes to one U+FFFD per byte
    with SentencePiece byte fallback), so the search runs on the tokens' *byte* offsets, which
    are, then checks decoded prefixes around the candidate.
    """
    ends = tokenizer.byte_offsets(ids)
    budget = len(text.encode("utf-8", "surrogatepass")) + 1  # +1: SentencePiece drops a leading "▁"
    lo, hi = 0, len(ids)
    while lo < hi:  # largest k with ends[k - 1] <= budget
        mid = (lo + hi + 1) // 2
        if ends[mid - 1] <= budget:
            lo = mid
        else:
            hi = mid - 1
    for k in range(min(len(ids), lo + _WINDOW), -1, -1):
        prefix = tokenizer.decode(ids[:k])
        if text.startswith(prefix):
            return k, len(prefix)
    return 0, 0  # pragma: no cover - decode([]) == "" is a prefix of anything


def token_char_spans(tokenizer, ids: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` character span of every token in ``decode(ids)``.

    Tokens that share a character (UTF-8 split across tokens) all get the whole character's span,
    so "a token lies wholly inside a slice" means all of its bytes' characters do.
    """
    text = tokenizer.decode(ids)
    offsets = tokenizer.byte_offsets(ids)
    data = text.encode("utf-8", "surrogatepass")
    shift = (offsets[-1] - len(data)) if ids else 0  # SentencePiece drops the first "▁" (1 byte)
    if "\ufffd" not in text and shift in (0, 1):  # exact: map each token's bytes to characters
        char_at = [i for i, ch in enumerate(text) for _ in range(len(ch.encode("utf-8", "surrogatepass")))]
        spans, prev = [], 0
        for end in offsets:
            b0, b1 = max(prev - shift, 0), max(end - shift, 0)
            a = char_at[b0] if b0 < len(data) else len(text)
            spans.append((a, char_at[b1 - 1] + 1 if b1 > b0 else a))
            prev = end
        return spans
    texts = [tokenizer.decode(ids[: k + 1]) for k in range(len(ids))]
    complete = [not t.endswith("\ufffd") for t in texts]
    cols: list[list[int]] = []  # [start, end] per token, ends fixed below
    start = 0
    for k, t in enumerate(texts):
        cols.append([start, len(t)])
        if complete[k]:
            start = len(t)
    end = len(texts[-1]) if texts else 0
    for k in range(len(ids) - 1, -1, -1):  # an incomplete token ends where its character ends
        if complete[k]:
            end = len(texts[k])
        cols[k][1] = max(end, cols[k][0])
    return [(a, b) for a, b in cols]


class Detokenizer:
    """Incremental text of tokens appended after a context (for streaming and stop strings).

    ``text`` is exactly what the new tokens add to ``decode(context + new)``. It can still
    change at its end: an incomplete UTF-8 character shows as U+FFFD until the next token
    completes it, and SentencePiece byte-fallback tokens (``<0xNN>``) are decoded as a group, so
    a run of them may turn into replacement characters when the run ends invalid.
    :meth:`stable_text` is the part that can no longer change.
    """

    __slots__ = ("tokenizer", "context", "ids", "_ctx_text", "text", "_stable")

    def __init__(self, tokenizer, context: Sequence[int]):
        self.tokenizer = tokenizer
        self.context = list(context[-_WINDOW:])
        self._ctx_text = tokenizer.decode(self.context)
        self.ids: list[int] = []
        self.text = ""
        self._stable = ""

    def copy(self) -> Detokenizer:
        new = Detokenizer.__new__(Detokenizer)
        new.tokenizer, new.context, new._ctx_text = self.tokenizer, self.context, self._ctx_text
        new.ids, new.text, new._stable = list(self.ids), self.text, self._stable
        return new

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.context + self.ids)
        self.text = full[len(self._ctx_text):] if full.startswith(self._ctx_text) else full
        if token_id not in self.tokenizer.byte_fallback_ids:
            self._stable = self.text.rstrip("\ufffd")
        return self.text

    def stable_text(self) -> str:
        return self._stable
