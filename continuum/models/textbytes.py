"""The text of a row is the text of its bytes: one decoder for every row's text.

A row's text is the UTF-8 decoding, with standard replacement, of the concatenated bytes of its
tokens (special tokens have none): ``data.decode("utf-8", "replace")``, where only an invalid or
incomplete sequence becomes one U+FFFD. A SentencePiece decoder that strips the first leading space
(``Strip(" ", 1, 0)``) drops the row's first byte when it is a space, as Hugging Face does.

Why not Hugging Face's decoder: its ``ByteFallback`` step turns a whole run of ``<0xNN>`` tokens that
is not valid UTF-8 into one U+FFFD *per byte*, so a row ending inside a character, plus text whose
tokens are byte tokens, reads ``"\\ufffd" * n`` where the added text should be. Decoding bytes is
prefix-stable: ``decode(a + b)`` starts with ``decode(a)``, but for a last U+FFFD standing for an
incomplete character that ``b`` completes, so ``str(state + x) == str(state) + x`` and streamed
chunks agree with the final text. Byte-level BPE decoders already decode bytes this way (Rust's
``from_utf8_lossy`` replaces like Python), so their text is unchanged.

Example:
    >>> dec = ByteDecoder([b"", b" \\xc3", b"\\xa9t\\xc3", b"\\xa9!"], strip_space=True)
    >>> dec.decode([0, 1]), dec.decode([0, 1, 2]), dec.decode([0, 1, 2, 3])
    ('\\ufffd', '\\xe9t\\ufffd', '\\xe9t\\xe9!')
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ByteDecoder", "ByteStream"]

_UTF8 = codecs.getincrementaldecoder("utf-8")
_CONTINUATION = bytes(range(0x80, 0xC0))  # bytes that continue a UTF-8 character


def _decoder_kind(backend: Any) -> tuple[str, bool] | None:
    """``("bytelevel" | "bytefallback", strips the first space)`` for a decoder this module reproduces
    exactly, else ``None`` (the tokenizer then decodes with Hugging Face)."""
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:  # pragma: no cover - a decoder that does not serialise
        return None
    if spec.get("type") == "ByteLevel":
        return "bytelevel", False
    steps = spec.get("decoders") if spec.get("type") == "Sequence" else None
    if not steps:
        return None
    types = [s.get("type") for s in steps]
    strip = types[-1] == "Strip"
    if strip and (steps[-1].get("content") != " " or steps[-1].get("start") != 1 or steps[-1].get("stop") != 0):
        return None
    replace = steps[0] if types[0] == "Replace" else {}
    if (replace.get("pattern") != {"String": "\u2581"} or replace.get("content") != " "
            or types[1:len(types) - strip] != ["ByteFallback", "Fuse"]):
        return None
    return "bytefallback", strip


class ByteDecoder:
    """Decodes rows of token ids by their bytes (``table[id]``; ids past the table have none).

    ``strip_space``: drop the row's first byte when it is a space (SentencePiece's ``Strip`` decoder).
    """

    __slots__ = ("table", "strip_space", "kind", "_singles")

    def __init__(self, table: Sequence[bytes], strip_space: bool, kind: str = "bytes"):
        self.table, self.strip_space, self.kind = list(table), strip_space, kind
        self._singles: dict[int, int] | None = None

    def byte_token(self, byte: int) -> int | None:
        """A token whose bytes are ``byte`` alone (``<0xNN>``, a byte-level BPE byte), for 0x80-0xFF: what
        completes a character a kept token left incomplete; ``None`` when the vocabulary has none."""
        if self._singles is None:
            self._singles = {}
            for idx, data in enumerate(self.table):
                if len(data) == 1 and data[0] >= 0x80:
                    self._singles.setdefault(data[0], idx)
        return self._singles.get(byte)

    @classmethod
    def of(cls, hf: Any, token_bytes: Callable[[], Sequence[bytes | None]]) -> ByteDecoder | None:
        """The decoder of a Hugging Face tokenizer, or ``None`` when its decoder is not one of the two
        families reproduced here (byte-level BPE; SentencePiece with byte fallback).

        ``token_bytes()``: every id's bytes as its decoder makes them. Special tokens (the added tokens
        marked special: what ``skip_special_tokens`` skips) have none; every other token, added ones
        included, has its bytes.
        """
        backend: Any = getattr(hf, "backend_tokenizer", None)
        kind = _decoder_kind(backend)
        if kind is None:
            return None
        table = [data or b"" for data in token_bytes()]
        for idx, token in backend.get_added_tokens_decoder().items():
            if token.special and idx < len(table):
                table[idx] = b""
        return cls(table, kind[1], kind[0])

    def row_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of a row's text (the stripped first space included)."""
        table = self.table
        try:
            return b"".join([table[i] for i in ids])
        except IndexError:  # an id past the vocabulary (a model's padded embedding) decodes to nothing
            n = len(table)
            return b"".join([table[i] if 0 <= i < n else b"" for i in ids])

    def decode(self, ids: Sequence[int]) -> str:
        data = self.row_bytes(ids)
        if self.strip_space and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", "replace")

    def char_ends(self, ids: Sequence[int]) -> tuple[list[int], list[bool]]:
        """Per token ``k``: the characters of ``decode(ids[:k + 1])`` that later tokens cannot change, and
        whether one more (a U+FFFD for an incomplete character) follows them.

        ``len(decode(ids[:k + 1])) == done[k] + pending[k]``, and ``decode(ids)`` starts with the first
        ``done[k]`` characters of ``decode(ids[:k + 1])``.
        """
        parts = [self.row_bytes((i,)) for i in ids]
        data = b"".join(parts)
        drop = int(self.strip_space and data[:1] == b" ")
        try:
            data[drop:].decode("utf-8")
        except UnicodeDecodeError:  # replacement characters: decode token by token
            return self._char_ends_stream(ids)
        done, pending, pos, leads, end = [], [], 0, 0, len(data)
        for p in parts:  # valid UTF-8: characters = bytes that start one (not 0b10xxxxxx)
            pos += len(p)
            leads += len(p.translate(None, _CONTINUATION))
            inside = pos < end and 0x80 <= data[pos] < 0xC0
            done.append(leads - (drop if pos else 0) - inside)
            pending.append(inside)
        return done, pending

    def _char_ends_stream(self, ids: Sequence[int]) -> tuple[list[int], list[bool]]:
        stream = ByteStream(self, ())
        done, pending = [], []
        for i in ids:
            stream.push(i)
            done.append(len(stream.done))
            pending.append(stream.pending)
        return done, pending


class ByteStream:
    """The text that tokens appended after a context add to the context's text, one token at a time.

    ``text`` equals ``decode(context + pushed)[len(decode(context)):]``; it ends with a U+FFFD while a
    character is incomplete (``pending``), which the next token may complete (the U+FFFD then becomes
    that character). ``done`` is the part no later token can change.

    Example:
        >>> s = ByteStream(ByteDecoder([b"a", b"\\xf0\\x9f", b"\\x98\\x80"], strip_space=False), [0])
        >>> s.push(1), s.stable_text(), s.push(2)
        ('\\ufffd', '', '\\U0001f600')
    """

    __slots__ = ("dec", "utf8", "done", "skip", "strip", "pending")

    def __init__(self, dec: ByteDecoder, context: Sequence[int]):
        self.dec = dec
        self.utf8 = _UTF8("replace")
        tail, n = b"", len(context)
        while n and len(tail) < 4:  # the context's last bytes hold its incomplete character, if any
            n -= 1
            tail = dec.row_bytes(context[n:n + 1]) + tail
        self.strip = dec.strip_space and not tail  # no bytes yet: the first one may be the space to drop
        self.utf8.decode(tail)
        self.pending = bool(self.utf8.getstate()[0])
        self.skip = int(self.pending)  # the context's own text already counts that character as a U+FFFD
        self.done = ""

    def copy(self) -> ByteStream:
        new = ByteStream.__new__(ByteStream)
        new.dec, new.done, new.skip, new.strip, new.pending = self.dec, self.done, self.skip, self.strip, self.pending
        new.utf8 = _UTF8("replace")
        new.utf8.setstate(self.utf8.getstate())
        return new

    def push(self, token_id: int) -> str:
        """Append a token; returns the new ``text``."""
        data = self.dec.row_bytes((token_id,))
        if self.strip and data:
            self.strip = False
            if data[:1] == b" ":
                data = data[1:]
        if data:
            out = self.utf8.decode(data)
            if self.skip and out:  # the context's incomplete character, now resolved: the context counted it
                out, self.skip = out[1:], 0
            self.done += out
            self.pending = bool(self.utf8.getstate()[0])
        return self.text

    @property
    def text(self) -> str:
        if not self.pending or self.skip:
            return self.done
        # the pending bytes as the whole row's decoding shows them: one U+FFFD for a character's beginning, more for
        # bytes no character begins with that Python's incremental decoder still holds (b"\xed\xa0": a surrogate's)
        return self.done + self.utf8.getstate()[0].decode("utf-8", "replace")

    def stable_text(self) -> str:
        """The part of ``text`` no later token can change."""
        return self.done
