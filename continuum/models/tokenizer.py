"""Tokenizer adapter: batch encoding, exact decoding, pad handling and the outlines-core vocabulary.

Two facts drive this module:

* The text of a row is the text of its tokens' bytes (:mod:`continuum.models.textbytes`), never the
  concatenation of decoded tokens (byte-level BPE splits UTF-8 characters across tokens; SentencePiece
  drops the leading space of the first token). Everything that needs text decodes whole rows.
* Text appended to a row must be tokenized *as a continuation*: a SentencePiece tokenizer
  turns ``"ing"`` into ``"▁ing"`` when it is encoded on its own. :meth:`Tokenizer.encode_continuation`
  encodes the text behind a sentinel character whose tokens never merge with what follows, then
  drops the sentinel's tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from ..errors import TokenizerError, UnencodableTextError
from .idmap import id_map_fingerprint
from .textbytes import ByteDecoder

logger = logging.getLogger("continuum")

__all__ = ["Tokenizer", "check_encodable"]

# Sentinels tried in order by encode_continuation; "\n" is a byte token in every common tokenizer.
_SENTINELS = ("\n", "\u00a7", "#")
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (used by every byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def check_encodable(texts: str | Sequence[str], argument: str) -> None:
    """Raise :class:`~continuum.errors.UnencodableTextError` if a text holds a character UTF-8 cannot encode
    (a lone surrogate), naming ``argument``, the list item and the character's position.

    Every text reaching the tokenizer passes here (tokenizers would raise an opaque ``TypeError``).
    """
    single = isinstance(texts, str)
    for i, text in enumerate([texts] if single else texts):
        if not isinstance(text, str) or text.isascii():
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            where = argument if single else f"{argument} {i} of the list"
            raise UnencodableTextError(
                f"{where} cannot be encoded as UTF-8: character {exc.start} ({text[exc.start]!r}) is a lone surrogate "
                f"(a careless decode makes them); clean it first, e.g. text.encode('utf-8', 'replace').decode() "
                f"(or errors='ignore' to drop it)", argument=argument, position=exc.start) from None


_REMEMBERED, _REMEMBERED_CHARS = 4096, 256  # encode_continuation remembers texts up to this long, this many


class Tokenizer:
    """Wraps a Hugging Face tokenizer with the operations the decoding loop needs.

    A tokenizer without a pad token gets its EOS token as pad token (logged once); a tokenizer
    with neither raises :class:`~continuum.errors.TokenizerError`.

    Example:
        >>> tok = Tokenizer(AutoTokenizer.from_pretrained("gpt2"))  # doctest: +SKIP
        >>> tok.encode_continuation(" world")                     # doctest: +SKIP
        [995]
    """

    def __init__(self, hf_tokenizer: Any, generation_eos: int | Sequence[int] | None = None):
        self.hf = hf_tokenizer
        self._continuations: dict[str, tuple[int, ...]] = {}  # encode_continuation's remembered short texts
        eos = hf_tokenizer.eos_token_id
        if hf_tokenizer.pad_token_id is None:
            if eos is None:
                raise TokenizerError(
                    "The tokenizer has neither a pad token nor an EOS token; set one, e.g. "
                    "`tokenizer.pad_token = '<pad>'` after adding it to the vocabulary."
                )
            logger.info("The tokenizer has no pad token; using its EOS token %r as pad token.", hf_tokenizer.eos_token)
        self.pad_token_id: int = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else eos
        eos_ids = set()
        if eos is not None:
            eos_ids.add(int(eos))
        if generation_eos is not None:
            eos_ids.update([generation_eos] if isinstance(generation_eos, int) else generation_eos)
        self.eos_token_id: int | None = int(eos) if eos is not None else (min(eos_ids) if eos_ids else None)
        self.eos_token_ids: frozenset[int] = frozenset(int(i) for i in eos_ids)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.special_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids) | self.eos_token_ids
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self.index_cache: dict[str, Any] = {}  # compiled guides, keyed by engine and constraint
        self._llg_lock = threading.Lock()
        self._llg_tokenizer: Any = None
        self.heal_cache: dict[Any, Any] = {}  # token healing: candidate sets per removed token (healing.py)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab={len(self.hf)})"

    def __len__(self) -> int:
        """Tokens in the vocabulary, added tokens included (the tokenizer's size, not the model's logits width)."""
        return len(self.hf)

    # -- identity -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return getattr(self.hf, "name_or_path", "") or type(self.hf).__name__

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the vocabulary and special tokens: equal fingerprints tokenize alike."""
        vocab = sorted(self.hf.get_vocab().items(), key=lambda kv: kv[1])
        payload = json.dumps([vocab, sorted(self.eos_token_ids), self.bos_token_id, self.pad_token_id])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    # -- chat templates (continuum.chat): the same four calls on every backend's tokenizer ---------
    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own chat template, or None."""
        return getattr(self.hf, "chat_template", None) or None

    def apply_chat_template(self, conversation: Sequence[dict], **options: Any) -> Any:
        """transformers' ``apply_chat_template`` (``return_dict=False``)."""
        return self.hf.apply_chat_template(list(conversation), **{**options, "return_dict": False})

    def encode_special(self, text: str) -> list[int]:
        """Ids of ``text`` with the special tokens written in it parsed (``"<|im_end|>"`` is one token), none added."""
        return self._encode_plain(text)

    def added_token_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one added token (``"<think>"`` in Qwen3), else None."""
        added = self.hf.get_added_vocab() if hasattr(self.hf, "get_added_vocab") else {}
        return int(added[text]) if text in added else None

    def token_name(self, token: int) -> str:
        """A token's entry in the vocabulary (``"<s>"``, ``"Ġthe"``), for displays."""
        return str(self.hf.convert_ids_to_tokens(token) or f"id {token}")

    @cached_property
    def ids_fingerprint(self) -> str:
        """What the ids mean, hashed alike by every backend's tokenizer (:mod:`continuum.models.idmap`): a state moves
        to a model whose tokenizer has the same one (e.g. the same vocabulary as a GGUF on llama.cpp)."""
        added = getattr(self.hf, "added_tokens_decoder", {})  # added special tokens: no bytes, like llama.cpp's control ones
        marked = {int(i) for i, t in added.items() if getattr(t, "special", False)}
        table = [None if i in marked else b for i, b in enumerate(self.vocab_bytes)]
        return id_map_fingerprint(table, lambda i: self.hf.convert_ids_to_tokens(i), self.bos_token_id,
                                  self.eos_token_ids)

    # -- encoding ---------------------------------------------------------------------------
    def encode_prompts(self, prompts: Sequence[str], argument: str = "prompt") -> list[list[int]]:
        """Tokenize prompts like HF does (with the tokenizer's default special tokens, e.g. BOS).

        Raises :class:`~continuum.errors.UnencodableTextError` (naming ``argument``) for text UTF-8 cannot encode.
        """
        prompts = list(prompts)
        check_encodable(prompts[0] if len(prompts) == 1 else prompts, argument)
        return [list(ids) for ids in self.hf(list(prompts), add_special_tokens=True)["input_ids"]]

    def _encode_plain(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def _encode_text(self, text: str) -> list[int]:
        # A special token's literal in added text stays text ('a</s>b' reads 'a</s>b'), as on llama.cpp: parsed,
        # it became the EOS token mid-row, which a row's text skips. Chats and markers use encode_special.
        return list(self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def encode_continuation(self, text: str, argument: str = "the text added") -> list[int]:
        """Tokens of ``text`` appended to an existing row (no special tokens, no SentencePiece prefix).

        Short texts are remembered (a bounded map): a program appends the same separators and scores the same
        options call after call, and each encoding is two tokenizer calls and two decodes."""
        if not text:
            return []
        hit = self._continuations.get(text)
        if hit is not None:
            return list(hit)
        check_encodable(text, argument)
        ids = self._encode_continuation(text)
        if len(text) <= _REMEMBERED_CHARS:
            if len(self._continuations) >= _REMEMBERED:
                self._continuations.clear()  # (simple bound: a working set rebuilds itself at once)
            self._continuations[text] = tuple(ids)
        return ids

    def _encode_continuation(self, text: str) -> list[int]:
        for sentinel in _SENTINELS:
            head = self._encode_text(sentinel)
            ids = self._encode_text(sentinel + text)
            if ids[: len(head)] == head and self.decode(ids) == self.decode(head) + text:
                return ids[len(head) :]
        return self._encode_text(text)  # pragma: no cover - no sentinel stays separate

    def encode_continuations(self, texts: Sequence[str], argument: str = "the text added") -> list[list[int]]:
        """:meth:`encode_continuation` of many texts, in one batched tokenizer call where it can."""
        if not texts:
            return []
        check_encodable(list(texts), argument)
        head = self._encode_text(_SENTINELS[0])
        batch = [list(ids) for ids in self.hf([_SENTINELS[0] + t for t in texts], add_special_tokens=False,
                                              split_special_tokens=True)["input_ids"]]
        head_text = self.decode(head)
        out = []
        for text, ids, decoded in zip(texts, batch, self.decode_batch(batch)):
            if text and ids[:len(head)] == head and decoded == head_text + text:
                out.append(ids[len(head):])
            else:  # the sentinel merged, or SentencePiece dropped a space: the careful way
                out.append(self.encode_continuation(text))
        return out

    # -- decoding ---------------------------------------------------------------------------
    @cached_property
    def bytes_decoder(self) -> ByteDecoder | None:
        """The bytes-based decoder of rows (:mod:`continuum.models.textbytes`); ``None`` for a decoder
        it does not reproduce (neither byte-level BPE nor SentencePiece byte fallback): Hugging Face decodes."""
        dec = ByteDecoder.of(self.hf, lambda: self._all_token_bytes)
        if dec is None:
            logger.info("Tokenizer %r: unknown decoder; row texts are decoded by Hugging Face", self.name)
        return dec

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of a row: its tokens' bytes decoded with standard UTF-8 replacement, special tokens skipped;
        ``skip_special=False``: Hugging Face's decoding with the special tokens' text (to compare renderings)."""
        dec = self.bytes_decoder
        if dec is not None and skip_special:
            return dec.decode(ids)
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)

    def decode_batch(self, rows: Sequence[Sequence[int]]) -> list[str]:
        if self.bytes_decoder is None and self._backend is not None:
            return self._backend.decode_batch([list(r) for r in rows], skip_special_tokens=True)
        return [self.decode(r) for r in rows]

    def piece_bytes(self, token: int) -> bytes:
        """The bytes one token adds to a row's text (``b""``: a special token, or a tokenizer decoded by Hugging Face)."""
        dec = self.bytes_decoder
        return dec.row_bytes((token,)) if dec is not None else b""

    def char_ends(self, ids: Sequence[int]) -> tuple[list[int], list[bool]]:
        """Per token ``k``: the characters of ``decode(ids[:k + 1])`` that no later token changes, and whether
        a U+FFFD for an incomplete character follows them (:meth:`ByteDecoder.char_ends`, one pass)."""
        if self.bytes_decoder is not None:
            return self.bytes_decoder.char_ends(ids)
        texts = [self.decode(ids[:k + 1]) for k in range(len(ids))]  # Hugging Face decoding: prefix by prefix
        pending = [t.endswith("\ufffd") for t in texts]
        return [len(t) - p for t, p in zip(texts, pending)], pending

    @cached_property
    def _byte_lengths(self) -> dict[int, int]:
        dec = self.bytes_decoder  # the bytes a row's text is decoded from (special tokens: none)
        table = dec.table if dec is not None else [data or b"" for data in self.vocab_bytes]
        return {idx: len(data) for idx, data in enumerate(table)}

    @cached_property
    def _all_token_bytes(self) -> list[bytes | None]:
        """The bytes of every token id, special tokens included (``None``: an unknown id)."""
        vocab = self.hf.get_vocab()
        out: list[bytes | None] = [None] * (max(vocab.values()) + 1)
        for token, idx in vocab.items():
            out[idx] = self.token_bytes(token)
        return out

    @cached_property
    def vocab_bytes(self) -> list[bytes | None]:
        """The bytes of every token id (``None`` for special tokens and unknown ids)."""
        special = self.special_ids
        return [None if idx in special else data or None for idx, data in enumerate(self._all_token_bytes)]

    def byte_offsets(self, ids: Sequence[int]) -> list[int]:
        """Cumulative byte length of the tokens: where each ends in the bytes of the row's text."""
        out, total, lengths = [], 0, self._byte_lengths
        for i in ids:
            total += lengths.get(i, 0)
            out.append(total)
        return out

    # -- outlines-core vocabulary -------------------------------------------------------------
    @cached_property
    def is_byte_level(self) -> bool:
        decoder = getattr(self._backend, "decoder", None)
        return decoder is not None and "ByteLevel" in repr(decoder)

    def token_bytes(self, token: str) -> bytes | None:
        """The bytes a vocabulary entry stands for, or ``None`` if it cannot be known."""
        if self.is_byte_level:
            try:
                return bytes(_UNICODE_TO_BYTE[c] for c in token)
            except KeyError:
                return token.encode()  # an added (non byte-level) token
        m = _BYTE_TOKEN.match(token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode()

    @cached_property
    def vocabulary(self) -> Any:  # outlines_core.Vocabulary (untyped)
        """The outlines-core ``Vocabulary`` (token bytes -> ids), without special tokens."""
        from outlines_core import Vocabulary

        if self.eos_token_id is None:
            raise TokenizerError("Constrained generation needs a tokenizer with an EOS token.")
        mapping: dict[bytes, list[int]] = {}
        for idx, data in enumerate(self.vocab_bytes):  # special tokens are None there
            if data:
                mapping.setdefault(data, []).append(idx)
        return Vocabulary(self.eos_token_id, mapping)

    # -- llguidance tokenizer -------------------------------------------------------------------
    @property
    def llg_tokenizer(self):
        """The llguidance ``LLTokenizer`` (built once, ~0.4 s for GPT-2 and ~3 s for a 128k vocabulary;
        thread-safe: concurrent first calls build it once). Its EOS is this tokenizer's ``eos_token_id``."""
        if self._llg_tokenizer is None:
            with self._llg_lock:
                if self._llg_tokenizer is None:
                    import llguidance.hf

                    if self.eos_token_id is None:
                        raise TokenizerError("Constrained generation needs a tokenizer with an EOS token.")
                    try:
                        self._llg_tokenizer = llguidance.hf.from_tokenizer(self.hf, eos_token=self.eos_token_id)
                    except Exception as exc:
                        raise TokenizerError(
                            f"llguidance cannot use this tokenizer ({exc}); it needs a fast (Rust-backed) Hugging Face "
                            "tokenizer: load it with use_fast=True, or use backend='outlines' where available") from exc
        return self._llg_tokenizer
