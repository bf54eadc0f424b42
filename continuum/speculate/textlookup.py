"""Drafting by text lookup: the row's text (not its tokens) is searched for its own end, earlier.

Token n-grams miss where the same text is tokenized differently: a value inside a JSON string (``"Eldmere"``
after ``": "``) is not tokenized as the document's `` Eldmere``, and a key's punctuation (``": "``) is nowhere in the
document. This module works on the row's bytes (the tokens' bytes joined: :meth:`ByteDecoder.row_bytes`, cached per
row so a step decodes only its new tokens):

* the key is the longest end of the row's text (up to ``_MAX_KEY`` bytes) found earlier in the row (``bytes.rfind``,
  binary search on its length: an end that occurs earlier has every shorter end occur too), at least ``min_chars``
  bytes, or 1 when it is a constrained value's start (after the ``"`` or ``:`` that opened a JSON value);
* the draft is the text that followed the key's latest earlier occurrence, tokenized with the model's tokenizer
  behind the key (``encode_continuation(key + text)`` with the key's tokens dropped where a token ends exactly at
  the key's end: the tokens as the model would write them; else the text alone);
* inside a JSON string value the text is cut at the end of the word and closed in the row's own style (``", "``),
  and the JSON up to the next value is appended (the *skeleton*: the tokens the guide forces, such as the next key,
  and where it forces none the first of the row's separators it allows, such as ``": "``), re-tokenized with the
  rest: one forward verifies the rest of the value, its closing and the next key, and its last position samples
  the next value's first token;
* between values (a row that sampled ``{``, ``",`` or a number's ``,``) the draft is the skeleton alone.

The loop verifies every draft (:mod:`continuum.loop.steps`): a wrong draft costs positions in the forward, never a
token of the output.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np

from ..guides import DEAD

__all__ = ["TextLookup"]

_MAX_KEY = 48  # the longest key tried (bytes): longer ends say little more about what follows
_CACHE = 8  # rows whose bytes are kept (one per row drafting now, across calls sharing a speculator)
_NUMBER = re.compile(rb"\s*:( ?-?[0-9][0-9.eE+-]*)")  # after a key's closing quote: a number value so far
_COLON = re.compile(rb'"( ?: ?)["0-9tfn\[{-]')  # a key's close and its value: the row's separator
_COMMA = re.compile(rb'["0-9el\]}]( ?, ?)"')  # a member's end and the next key
_SKELETON_END = frozenset((b"{", b"[", b",", b":", b'"', b" "))  # (bytes a row between JSON values ends in)
_STOP = frozenset(b' ,.;:!?()[]{}"\\\n\t')  # where a word ends (a JSON string value's draft stops there)


class TextLookup:
    """The text lookup of one speculator (see the module docstring): its cache of rows' bytes."""

    def __init__(self, min_chars: int):
        self.min_chars = min_chars
        self._rows: list[tuple[np.ndarray, bytes]] = []  # (tokens, their bytes), most recent last
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # (a speculator pickles: its cache and lock stay behind)
        return {"min_chars": self.min_chars}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["min_chars"])  # type: ignore[misc]

    # -- the row's bytes ------------------------------------------------------------------------------------
    def row_bytes(self, dec: Any, history: np.ndarray) -> bytes:
        """The bytes of ``history``'s tokens, from the longest cached row it starts with (only new tokens decoded)."""
        n = len(history)
        with self._lock:
            best, at = 0, -1
            for i, (ids, _) in enumerate(self._rows):
                m = len(ids)
                if best < m <= n and np.array_equal(history[:m], ids):
                    best, at = m, i
            data = self._rows.pop(at)[1] if at >= 0 else b""
            data += dec.row_bytes(history[best:].tolist())
            self._rows.append((history.copy(), data))
            del self._rows[:-_CACHE]
        return data

    # -- the draft ------------------------------------------------------------------------------------------
    def draft(self, history: np.ndarray, limit: int, tokenizer: Any, guide: Any = None,
              state: Any = None) -> list[int] | None:
        """At most ``limit`` tokens of the text that followed the latest earlier occurrence of the row's text's end;
        under a guide, at a JSON value or between values (``None`` elsewhere: the token lookup's turn)."""
        dec = getattr(tokenizer, "bytes_decoder", None)
        if dec is None or limit <= 0 or len(history) < 2:
            return None
        data = self.row_bytes(dec, history)
        n = len(data)
        value, quoted = self._value_start(data) if guide is not None else (-1, False)
        if guide is not None and state is not None and value < 0 and data[-1:] in _SKELETON_END:
            tail = _skeleton(tokenizer, dec, guide, guide.copy(state), _style(data), limit,
                             after=data[-8:].decode("utf-8", "ignore"))
            return tokenizer.encode_continuation(tail)[:limit] if tail else None
        # the key: the longest end of the text (not reaching back past a value's opening) found earlier
        hi = min(_MAX_KEY, n - 1, n - value if value >= 0 else n - 1)
        lo = 1 if value >= 0 else self.min_chars
        if hi < lo:
            return [] if value >= 0 else None  # (a value just opened: nothing to look up yet)
        found, size = -1, 0
        while lo <= hi:  # binary search: the end of length L occurs earlier => so does every shorter end
            mid = (lo + hi) // 2
            at = data.rfind(data[n - mid:], 0, n - 1)  # (an occurrence with at least one byte after it)
            if at >= 0:
                found, size, lo = at, mid, mid + 1
            else:
                hi = mid - 1
        if found < 0 or (size < self.min_chars and size != n - value):  # (a short key: only a whole value so far)
            return [] if value >= 0 else None
        start = found + size
        cont = data[start:start + 12 * limit]
        if value >= 0:  # a value: up to the word's end (the next word's, at a word's end: a value seldom
            one = quoted and _one_token(dec.table, history, n - value)  # ends on a word that took several
            cont = b"" if one and cont[:1] in _STOP else self._word(cont)  # tokens; one token: close it)
        text = _utf8(cont)
        if not text and not quoted:  # (a string value whose word is done: its draft is its closing)
            return [] if value >= 0 else None
        key = _utf8(data[n - size:])
        ids = self._tokens(tokenizer, dec, key, text)
        if quoted and guide is not None and state is not None:
            ids = self._close(tokenizer, dec, guide, state, key, text, ids, limit, data, value)
        elif len(cont) == 12 * limit and len(ids) > 1:  # the text was cut: its last token may be a part of one
            ids = ids[:-1]
        return ids[:limit]

    @staticmethod
    def _value_start(data: bytes) -> tuple[int, bool]:
        """Where the JSON value the text ends in starts (after its opening ``"``, or after the ``:`` before a
        number), and whether it is a string; ``(-1, False)`` elsewhere (the last 256 bytes decide)."""
        q = data.rfind(b'"', max(0, len(data) - 256))
        if q < 0:
            return -1, False
        if data[max(0, q - 4):q].rstrip(b" ").endswith((b":", b"[", b",")):  # a value's opening quote (an array
            inside = data[q + 1:]  # item after a comma too; a key's opening quote is forced: no draft there)
            return (q + 1, True) if b"\\" not in inside and b"\n" not in inside else (-1, False)
        number = _NUMBER.fullmatch(data, q + 1)
        return (number.start(1), False) if number else (-1, False)

    @staticmethod
    def _word(cont: bytes) -> bytes:
        """``cont`` up to the end of its first word (leading spaces kept with the word)."""
        i = len(cont) - len(cont.lstrip(b" "))
        while i < len(cont) and cont[i] not in _STOP:
            i += 1
        return cont[:i]

    @staticmethod
    def _tokens(tokenizer: Any, dec: Any, key: str, text: str) -> list[int]:
        """``text``'s tokens as they follow ``key``: the key and the text tokenized together, the key's tokens
        dropped, where a token ends exactly at the key's end; else the text alone."""
        if key:
            ids = tokenizer.encode_continuation(key + text)
            want, total = len(key.encode("utf-8")), 0
            table = dec.table
            for i, t in enumerate(ids):
                total += len(table[t]) if 0 <= t < len(table) else 0
                if total == want:
                    return ids[i + 1:]
                if total > want:
                    break
        return tokenizer.encode_continuation(text)

    def _close(self, tokenizer: Any, dec: Any, guide: Any, state: Any, key: str, text: str, ids: list[int],
               limit: int, data: bytes, value: int) -> list[int]:
        """A string value's draft closed: the text, ``"``, and what the guide forces and the row's style writes
        next (the next key and ``": "``), re-tokenized together (``",`` is one token where the model writes one);
        the plain draft where the guide refuses it."""
        s = guide.copy(state)
        for t in ids:
            s = guide.advance(s, t)
            if s is DEAD:
                return ids
        tail = _skeleton(tokenizer, dec, guide, s, _style(data), limit, closing=True)
        return (self._tokens(tokenizer, dec, key, text + tail) or ids) if tail.startswith('"') else ids


def _style(data: bytes) -> tuple[str, str]:
    """The row's own JSON separators, from the last ones it wrote: (after a key, between members); ``": "`` and
    ``", "`` before it wrote any."""
    tail = data[-512:]
    colon = [m.group(1) for m in _COLON.finditer(tail)]
    comma = [m.group(1) for m in _COMMA.finditer(tail)]
    return (colon[-1].decode() if colon else ": "), (comma[-1].decode() if comma else ", ")


def _skeleton(tokenizer: Any, dec: Any, guide: Any, s: Any, style: tuple[str, str], limit: int, closing: bool = False,
              after: str = "") -> str:
    """The JSON text from guide state ``s`` (walked on, in place) up to the next value: the tokens the guide forces
    and, where it forces none, the first of the row's style's separators it allows (``": "``, ``", "``...); a string
    value's ``closing`` only by pieces that start with its closing quote."""
    c, m = style
    close = ('"' + c + '"', '"' + c, c + '"', c)  # a key's close and its value's opening
    pieces: tuple[str, ...] = ('"' + m + '"', '"') if closing else close + ('"' + m + '"', ' "', m + '"')
    text, count = "", 0
    while count < limit and not guide.is_done(s):
        forced = guide.forced_tokens(s)
        if forced:
            for t in forced:
                s = guide.advance(s, t)
                if s is DEAD:
                    return text
            text += _utf8(dec.row_bytes(forced))
            count += len(forced)
            continue
        for piece in pieces:
            ids = tokenizer.encode_continuation(piece)
            s2 = guide.copy(s)
            for t in ids:
                s2 = guide.advance(s2, t)
                if s2 is DEAD:
                    break
            if s2 is not DEAD:
                break
        else:
            return text
        before = (after + text).rstrip(" ")
        s, text, count = s2, text + piece, count + len(ids)
        if ":" in piece or before.endswith(":"):  # a value starts: its text is the document's, not the skeleton's
            return text
        if piece.endswith('"'):  # a key opened: its close next (the guide may force its closing quote)
            pieces = close
    return text


def _walks(guide: Any, state: Any, ids: list[int]) -> bool:
    """Whether the guide allows ``ids`` from ``state`` (walked on a copy)."""
    s = guide.copy(state)
    for t in ids:
        s = guide.advance(s, t)
        if s is DEAD:
            return False
    return True


def _one_token(table: Any, history: np.ndarray, size: int) -> bool:
    """Whether the row's last ``size`` bytes are (within) its last token."""
    t = int(history[-1])
    return 0 <= t < len(table) and len(table[t]) >= size


def _utf8(data: bytes) -> str:
    """``data`` as text, an incomplete last character left off; ``""`` where it starts inside a character."""
    if data[:1] and 0x80 <= data[0] < 0xC0:
        return ""
    return data.decode("utf-8", "ignore")
