"""Aligning tokens and characters.

The text of a row is ``tokenizer.decode(row)``: the text of its tokens' bytes (see
:mod:`continuum.models.textbytes`). A token has no text of its own (byte-level BPE splits UTF-8
characters across tokens, SentencePiece drops the first leading space), but decoding bytes is
prefix-stable, so token ``k`` ends at ``len(decode(ids[:k + 1]))`` and one pass over the row's
bytes (:meth:`~continuum.models.tokenizer.Tokenizer.char_ends`) places every token.

Example:
    >>> ids = tok.encode_prompts(["café"])[0]          # doctest: +SKIP
    >>> token_char_spans(tok, ids)                     # doctest: +SKIP
    [(0, 0), (0, 3), (3, 4)]
"""

from __future__ import annotations

from collections.abc import Sequence

from ..models.textbytes import _CONTINUATION, ByteStream

__all__ = ["longest_token_prefix", "byte_token_prefix", "token_char_spans", "detokenizer", "Detokenizer"]

_WINDOW = 8  # tokens of left context enough to decode any single character correctly (Hugging Face decoding)


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # largest n with a[:n] == b[:n] (startswith runs in C)
        mid = (lo + hi + 1) // 2
        if b.startswith(a[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def longest_token_prefix(tokenizer, ids: Sequence[int], text: str) -> tuple[int, int]:
    """The largest ``k`` with ``decode(ids[:k])`` a prefix of ``text``, and that prefix's length.

    ``decode(ids[:k])`` is the row's first ``done[k - 1]`` characters, then a U+FFFD while a character
    is incomplete (:meth:`~continuum.models.tokenizer.Tokenizer.char_ends`).
    """
    if not ids:
        return 0, 0
    done, pending = tokenizer.char_ends(ids)
    common = _common_prefix(tokenizer.decode(ids), text)
    for k in range(len(ids), 0, -1):
        c = done[k - 1]
        if c <= common and (not pending[k - 1] or text[c:c + 1] == "\ufffd"):
            return k, c + pending[k - 1]
    return 0, 0


def byte_token_prefix(tokenizer, ids: Sequence[int], text: str) -> tuple[int, list[int]] | None:
    """Where a cut to ``text`` falls inside a character split across tokens: the largest ``k`` whose tokens'
    bytes begin ``text``'s bytes, and tokens for the rest (the split character's missing bytes as byte tokens,
    then the text after it), or ``None`` when the cut does not leave a character incomplete there.

    ``ids = [a, 0xCE, 0xBB 0xCE, 0xBB]`` (``"aλλ"``) cut to ``"aλ"`` keeps ``a, 0xCE`` and appends ``0xBB``:
    token ``0xCE`` lies wholly in the kept text, so its cache and log-prob stay (by characters alone the
    longest kept prefix is ``a``).
    """
    dec = tokenizer.bytes_decoder
    if dec is None or not ids:
        return None
    data = dec.row_bytes(ids)
    lead = data[:1] if dec.strip_space and data[:1] == b" " else b""  # (the decoder drops it: so does text)
    want = lead + text.encode("utf-8", "surrogatepass")
    same = next((i for i, (x, y) in enumerate(zip(data, want)) if x != y), min(len(data), len(want)))
    k, kept = 0, 0
    for i in ids:  # the tokens whose bytes all lie in the common prefix
        size = len(dec.row_bytes((i,)))
        if kept + size > same:
            break
        k, kept = k + 1, kept + size
    rest = want[kept:]
    split = len(rest) - len(rest.lstrip(_CONTINUATION))  # the incomplete character's missing bytes
    if not split:
        return None
    pieces = [dec.byte_token(b) for b in rest[:split]]
    try:
        after = rest[split:].decode("utf-8")
    except UnicodeDecodeError:
        return None
    tail = [p for p in pieces if p is not None]
    if len(tail) < split:  # (a byte the vocabulary has no token of its own for)
        return None
    tail += tokenizer.encode_continuation(after)
    return (k, tail) if tokenizer.decode(list(ids[:k]) + tail) == text else None


def token_char_spans(tokenizer, ids: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` character span of every token in ``decode(ids)``.

    Tokens that share a character (UTF-8 split across tokens) all get the whole character's span,
    so "a token lies wholly inside a slice" means all of its bytes' characters do.
    """
    done, pending = tokenizer.char_ends(ids)
    spans, start = [], 0
    for c, p in zip(done, pending):
        spans.append((start, c + p))  # an incomplete character starts at c, and ends one further
        start = c
    return spans


class Detokenizer:
    """Incremental text of tokens appended after a context, for a tokenizer decoded by Hugging Face
    (one whose decoder :mod:`continuum.models.textbytes` does not reproduce): :func:`detokenizer`."""

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
        self._stable = self.text.rstrip("\ufffd")
        return self.text

    def stable_text(self) -> str:
        return self._stable


def detokenizer(tokenizer, context: Sequence[int]) -> ByteStream | Detokenizer:
    """Incremental text of tokens appended after ``context`` (streaming and stop strings).

    ``push(id)`` returns ``text``, exactly what the new tokens add to ``decode(context + new)``; it can
    still change at its end, where an incomplete UTF-8 character shows as U+FFFD until the next token
    completes it. ``stable_text()`` is the part that can no longer change.

    Example:
        >>> d = detokenizer(tok, tok.encode_prompts(["Hi"])[0])   # doctest: +SKIP
        >>> d.push(tok.encode_continuation(" there")[0])          # doctest: +SKIP
        ' there'
    """
    dec = tokenizer.bytes_decoder
    return ByteStream(dec, context) if dec is not None else Detokenizer(tokenizer, context)
