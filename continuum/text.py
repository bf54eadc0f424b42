"""Aligning tokens and characters.

The text of a row is ``tokenizer.decode(row)``. A token has no text of its own (byte-level BPE
splits UTF-8 characters across tokens, SentencePiece drops the first leading space), so every
function here works with decoded *prefixes*: token ``k`` ends at ``len(decode(ids[:k + 1]))``.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["longest_token_prefix", "token_char_ends", "Detokenizer"]

_WINDOW = 8  # tokens of left context enough to decode any single character correctly


def longest_token_prefix(tokenizer, ids: Sequence[int], text: str) -> tuple[int, int]:
    """The largest ``k`` with ``decode(ids[:k])`` a prefix of ``text``, and that prefix's length.

    Binary search on decoded length (log(len(ids)) decodes), then a local walk that absorbs the
    non-monotonic spots of partial UTF-8 characters.
    """
    n = len(text)
    lo, hi = 0, len(ids)
    while lo < hi:  # largest k with len(decode(ids[:k])) <= n
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(ids[:mid])) <= n:
            lo = mid
        else:
            hi = mid - 1
    for k in range(min(len(ids), lo + 2), -1, -1):
        prefix = tokenizer.decode(ids[:k])
        if text.startswith(prefix):
            return k, len(prefix)
    return 0, 0  # pragma: no cover - decode([]) == "" is a prefix of anything


def token_char_ends(tokenizer, ids: Sequence[int]) -> list[int]:
    """``ends[k] = len(decode(ids[:k + 1]))`` for every token, using windowed decoding."""
    total = len(tokenizer.decode(ids))
    ends, pos = [], 0
    for k in range(len(ids)):
        lo = max(0, k - _WINDOW)
        if lo == 0:
            pos = len(tokenizer.decode(ids[: k + 1]))
        else:
            ctx = ids[lo:k]
            pos += len(tokenizer.decode(list(ctx) + [ids[k]])) - len(tokenizer.decode(ctx))
        ends.append(pos)
    if ends and ends[-1] != total:  # a window split a character oddly: exact, quadratic fallback
        ends = [len(tokenizer.decode(ids[: k + 1])) for k in range(len(ids))]
    return ends


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

    def copy(self) -> "Detokenizer":
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
