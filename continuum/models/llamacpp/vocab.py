"""The GGUF's own tokenizer, over ``llama_vocab``: the same interface as :class:`continuum.models.tokenizer.Tokenizer`.

Everything comes from llama.cpp itself, so the ids continuum decodes are the ids llama.cpp would produce:

* encoding is ``llama_tokenize`` (BOS as the GGUF says, ``llama_vocab_get_add_bos``; control tokens written in
  the text, such as ``<start_of_turn>``, are parsed as tokens only when ``parse_special`` is asked for: chat
  templates' output needs it, user text does not);
* every token's bytes are ``llama_token_to_piece(special=False)`` with a buffer that grows (725 Gemma 3 pieces
  are longer than 32 bytes, the size llama-cpp-python's helpers truncate at); control, unused and unknown tokens
  and user-defined ``<...>`` markers have no bytes (``None``);
* decoding joins the tokens' bytes (UTF-8, ``errors="replace"``), dropping the one space a SentencePiece
  vocabulary with ``add_space_prefix`` puts before the first word, so ``decode(encode(text)) == text``;
* the end-of-generation ids are every id ``llama_vocab_is_eog`` accepts (``<eos>`` and ``<end_of_turn>`` for Gemma 3);
* the outlines-core ``Vocabulary`` is built from those bytes, the llguidance tokenizer with
  ``llguidance.llamacpp.lltokenizer_from_vocab`` (its tokenization calls ``llama_tokenize`` itself), each once.

The vocabulary calls read the loaded, immutable vocabulary only (llguidance calls ``llama_tokenize`` from its own
threads, outside any lock), so they do not take the model's lock: tokenizing never waits behind a decode.

Example:
    >>> tok = LlamaTokenizer(LlamaCppModel("stories260K-f32.gguf"))     # doctest: +SKIP
    >>> ids = tok.encode_prompts(["Once upon a time"])[0]               # doctest: +SKIP
    >>> tok.decode(ids)                                                 # doctest: +SKIP
    'Once upon a time'
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import warnings
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from ...errors import TokenizerError
from ..idmap import id_map_fingerprint
from ..textbytes import ByteDecoder
from ..tokenizer import _SENTINELS, check_encodable
from ._lib import lib
from .model import LlamaCppModel

__all__ = ["LlamaTokenizer"]


class LlamaTokenizer:
    """The tokenizer of a GGUF model, from llama.cpp's vocabulary (see the module docstring).

    Args:
        model: the loaded model (its vocabulary pointer lives as long as the model).
        parse_special: default for encoding: parse control tokens written in the text (``"<eos>"`` becomes the
            EOS token) instead of tokenizing them as text. Each encode method takes it too.
    """

    def __init__(self, model: LlamaCppModel, *, parse_special: bool = False):
        self.model = model
        self.parse_special = parse_special
        L = lib()
        self._vocab = model.vocab_ptr
        self.n_vocab = model.n_vocab
        self.add_bos = bool(L.llama_vocab_get_add_bos(self._vocab))
        self.add_eos = bool(L.llama_vocab_get_add_eos(self._vocab))
        self.vocab_type = int(L.llama_vocab_type(self._vocab))
        bos, eos, pad = (int(f(self._vocab)) for f in (L.llama_vocab_bos, L.llama_vocab_eos, L.llama_vocab_pad))
        self.bos_token_id: int | None = bos if 0 <= bos < self.n_vocab else None
        self.eos_token_ids: frozenset[int] = frozenset(i for i in range(self.n_vocab) if L.llama_vocab_is_eog(self._vocab, i))
        if 0 <= eos < self.n_vocab:
            self.eos_token_id: int | None = eos
        else:
            self.eos_token_id = min(self.eos_token_ids) if self.eos_token_ids else None
        if self.eos_token_id is not None:
            self.eos_token_ids = self.eos_token_ids | {self.eos_token_id}
        if 0 <= pad < self.n_vocab:
            self.pad_token_id: int = pad
        elif self.eos_token_id is not None:
            self.pad_token_id = self.eos_token_id
        else:
            raise TokenizerError(f"the GGUF {model.path.name} has neither a pad nor an end-of-generation token")
        self.index_cache: dict[str, Any] = {}  # compiled guides, keyed by engine and constraint
        self.heal_cache: dict[Any, Any] = {}  # token healing: candidate sets per removed token (healing.py)
        self._llg_lock = threading.Lock()
        self._llg_tokenizer: Any = None

    def __repr__(self) -> str:
        return f"LlamaTokenizer({self.name!r}, vocab={self.n_vocab})"

    def __len__(self) -> int:
        return self.n_vocab

    # -- identity -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.model.metadata("general.name") or self.model.path.name

    @cached_property
    def fingerprint(self) -> str:
        """A hash of every token's bytes, attributes and the special ids: equal fingerprints tokenize alike."""
        h = hashlib.sha256(f"{self.vocab_type};{self.add_bos};{self.add_space_prefix};".encode())
        for piece, attr in zip(self._pieces, self._attrs):
            h.update(len(piece).to_bytes(4, "little") + piece + attr.to_bytes(4, "little"))
        h.update(repr((sorted(self.eos_token_ids), self.bos_token_id, self.pad_token_id)).encode())
        return h.hexdigest()[:16]

    @cached_property
    def ids_fingerprint(self) -> str:
        """What the ids mean, hashed alike by every backend's tokenizer (:mod:`continuum.models.idmap`): a state moves
        to a model whose tokenizer has the same one (e.g. the same vocabulary on transformers)."""
        L = lib()
        return id_map_fingerprint(self.vocab_bytes, lambda i: L.llama_vocab_get_text(self._vocab, i).decode("utf-8", "replace"),
                                  self.bos_token_id, self.eos_token_ids)

    # -- raw llama.cpp calls --------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool | None = None) -> list[int]:
        """``llama_tokenize`` of ``text``: ``add_special`` adds BOS/EOS as the GGUF says; ``parse_special`` reads
        control tokens written in the text (default: this tokenizer's ``parse_special``)."""
        L = lib()
        parse = self.parse_special if parse_special is None else parse_special
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            out = (ctypes.c_int32 * cap)()
            n = int(L.llama_tokenize(self._vocab, data, len(data), out, cap, add_special, parse))
            if n >= 0:
                return list(out[:n])
            if -n <= cap:  # pragma: no cover - llama.cpp's overflow code (INT32_MIN) for a result over 2^31 tokens
                raise TokenizerError(f"llama.cpp cannot tokenize a text of {len(data)} bytes")
            cap = -n

    def piece(self, token: int, special: bool) -> bytes:
        """llama.cpp's bytes for ``token`` (``llama_token_to_piece``; ``special``: control tokens as their text)."""
        L, size = lib(), 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = int(L.llama_token_to_piece(self._vocab, token, buf, size, 0, special))
            if n >= 0:
                return buf.raw[:n]
            size = -n

    @cached_property
    def _attrs(self) -> list[int]:
        L = lib()
        return [int(L.llama_vocab_get_attr(self._vocab, i)) for i in range(self.n_vocab)]

    @cached_property
    def _pieces(self) -> list[bytes]:
        return [self.piece(i, False) for i in range(self.n_vocab)]

    @cached_property
    def add_space_prefix(self) -> bool:
        """True if llama.cpp puts a space before the text's first word (SentencePiece ``add_space_prefix``)."""
        return self.decode_bytes(self.tokenize("a")) == b" a"

    # -- encoding -------------------------------------------------------------------------------
    def encode_prompts(self, prompts: Sequence[str], argument: str = "prompt", *,
                       parse_special: bool | None = None) -> list[list[int]]:
        """Tokenize prompts as llama.cpp does for a fresh sequence (BOS when the GGUF asks for it).

        Raises :class:`~continuum.errors.UnencodableTextError` (naming ``argument``) for text UTF-8 cannot encode.
        """
        prompts = list(prompts)
        check_encodable(prompts[0] if len(prompts) == 1 else prompts, argument)
        return [self.tokenize(p, add_special=True, parse_special=parse_special) for p in prompts]

    def encode_continuation(self, text: str, argument: str = "the text added", *, parse_special: bool | None = None) -> list[int]:
        """Tokens of ``text`` appended to an existing row (no BOS, no SentencePiece space prefix): the text is
        tokenized behind a sentinel whose tokens never merge with it, and the sentinel's tokens dropped."""
        if not text:
            return []
        check_encodable(text, argument)
        for sentinel in _SENTINELS:
            head = self.tokenize(sentinel, parse_special=parse_special)
            ids = self.tokenize(sentinel + text, parse_special=parse_special)
            if ids[:len(head)] == head and self.decode_bytes(ids[len(head):]) == text.encode("utf-8"):
                return ids[len(head):]
        return self.tokenize(text, parse_special=parse_special)  # pragma: no cover - no sentinel stays separate

    def encode_continuations(self, texts: Sequence[str], argument: str = "the text added", *,
                             parse_special: bool | None = None) -> list[list[int]]:
        """:meth:`encode_continuation` of many texts."""
        if not texts:
            return []
        check_encodable(list(texts), argument)
        return [self.encode_continuation(t, argument, parse_special=parse_special) for t in texts]

    # -- decoding -------------------------------------------------------------------------------
    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of the tokens joined (special tokens have none)."""
        vb = self.vocab_bytes
        return b"".join(vb[i] or b"" for i in ids if 0 <= i < len(vb))

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of a row: its tokens' bytes as UTF-8, without the space ``add_space_prefix`` put first;
        ``skip_special=False``: control tokens written as their text (``<end_of_turn>``), as a template renders them."""
        if not skip_special:
            return b"".join(self.piece(i, True) for i in ids).decode("utf-8", errors="replace")
        return self.bytes_decoder.decode(ids)

    @cached_property
    def bytes_decoder(self) -> ByteDecoder:
        """The row decoder the states use (:mod:`continuum.models.textbytes`): every token's bytes, the first space
        stripped when the GGUF adds one."""
        return ByteDecoder([data or b"" for data in self.vocab_bytes], self.add_space_prefix)

    def piece_bytes(self, token: int) -> bytes:
        """The bytes one token adds to a row's text (``b""``: a special token)."""
        return self.bytes_decoder.row_bytes((token,))

    def char_ends(self, ids: Sequence[int]) -> tuple[list[int], list[bool]]:
        """Per token: the characters of the row's text up to it that later tokens cannot change, and whether an
        incomplete character follows (:meth:`ByteDecoder.char_ends`)."""
        return self.bytes_decoder.char_ends(ids)

    def decode_batch(self, rows: Sequence[Sequence[int]]) -> list[str]:
        return [self.decode(r) for r in rows]

    # -- per-token bytes --------------------------------------------------------------------------
    @cached_property
    def vocab_bytes(self) -> list[bytes | None]:
        """The bytes of every token id; ``None`` for control, unused and unknown tokens and ``<...>`` markers."""
        L = lib()
        hidden = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_UNUSED | L.LLAMA_TOKEN_ATTR_UNKNOWN
        out: list[bytes | None] = []
        for piece, attr in zip(self._pieces, self._attrs):
            marker = attr & L.LLAMA_TOKEN_ATTR_USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">")
            out.append(None if attr & hidden or marker or not piece else piece)
        return out

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids without bytes (control, unused, unknown, ``<...>`` markers) and the end-of-generation ids."""
        return frozenset(i for i, b in enumerate(self.vocab_bytes) if b is None) | self.eos_token_ids

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of byte tokens (``<0xNN>`` in SentencePiece vocabularies), decoded as a group."""
        L = lib()
        return frozenset(i for i, a in enumerate(self._attrs) if a & L.LLAMA_TOKEN_ATTR_BYTE)

    @cached_property
    def is_byte_level(self) -> bool:
        """True for a byte-level BPE vocabulary (GPT-2 style)."""
        return self.vocab_type == lib().LLAMA_VOCAB_TYPE_BPE

    @cached_property
    def _byte_lengths(self) -> list[int]:
        return [len(b) if b else 0 for b in self.vocab_bytes]

    def byte_offsets(self, ids: Sequence[int]) -> list[int]:
        """Cumulative UTF-8 byte length of the tokens (monotonic, unlike decoded text lengths)."""
        out, total, lengths = [], 0, self._byte_lengths
        for i in ids:
            total += lengths[i] if 0 <= i < len(lengths) else 0
            out.append(total)
        return out

    @cached_property
    def _text_to_id(self) -> dict[str, int]:
        L = lib()
        return {L.llama_vocab_get_text(self._vocab, i).decode("utf-8", errors="replace"): i for i in range(self.n_vocab)}

    def token_bytes(self, token: str) -> bytes | None:
        """The bytes of a vocabulary entry given by its text in the GGUF (``"▁the"``, ``"<0x0A>"``), or None."""
        idx = self._text_to_id.get(token)
        return None if idx is None else self.vocab_bytes[idx]

    # -- chat templates (continuum.chat) -------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        """The GGUF's chat template (``tokenizer.chat_template``), or None."""
        return self.model.chat_template

    def apply_chat_template(self, conversation: Sequence[dict], **options: Any) -> Any:
        """Render ``conversation`` with a chat template, as ``transformers``' method of that name (:mod:`.template`)."""
        from .template import render_chat

        options.pop("return_dict", None)
        return render_chat(self, conversation, **options)

    @cached_property
    def special_texts(self) -> dict[str, str]:
        """The special tokens' texts templates read (``{"bos_token": "<bos>", ...}``), from the GGUF, once."""
        from .template import special_texts

        return special_texts(self)

    def encode_special(self, text: str) -> list[int]:
        """Ids of ``text`` with the control tokens written in it parsed (``"<end_of_turn>"`` is one token), no BOS."""
        return self.tokenize(text, add_special=False, parse_special=True)

    def added_token_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one control or user-defined token of the GGUF (``"<think>"``), else None."""
        ids = self.encode_special(text)
        L = lib()
        flags = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED
        return ids[0] if len(ids) == 1 and self._attrs[ids[0]] & flags else None

    def token_name(self, token: int) -> str:
        """A token's text in the vocabulary (``"<bos>"``, ``"▁the"``), for displays."""
        return lib().llama_vocab_get_text(self._vocab, token).decode("utf-8", errors="replace")

    # -- constraint engines ---------------------------------------------------------------------
    @cached_property
    def vocabulary(self) -> Any:  # outlines_core.Vocabulary (untyped)
        """The outlines-core ``Vocabulary`` (token bytes -> ids), without special tokens."""
        from outlines_core import Vocabulary

        if self.eos_token_id is None:
            raise TokenizerError("Constrained generation needs a tokenizer with an EOS token.")
        mapping: dict[bytes, list[int]] = {}
        for idx, data in enumerate(self.vocab_bytes):
            if data and idx not in self.eos_token_ids:
                mapping.setdefault(data, []).append(idx)
        return Vocabulary(self.eos_token_id, mapping)

    @property
    def llg_tokenizer(self) -> Any:
        """The llguidance ``LLTokenizer`` over llama.cpp's own tokenization, every end-of-generation id as EOS
        (built once, ~1 s for a 262k vocabulary; concurrent first calls build it once)."""
        if self._llg_tokenizer is None:
            with self._llg_lock:
                if self._llg_tokenizer is None:
                    import llguidance.llamacpp

                    if not self.eos_token_ids:
                        raise TokenizerError("Constrained generation needs a tokenizer with an EOS token.")
                    eos = sorted(self.eos_token_ids)
                    with warnings.catch_warnings():  # it calls llama_token_get_attr once per token: one deprecation
                        warnings.simplefilter("ignore", DeprecationWarning)  # warning each (262k on Gemma, ~10% of it)
                        self._llg_tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(self._vocab, eos_token=eos)
        return self._llg_tokenizer
