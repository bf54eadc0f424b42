"""What makes token ids mean the same thing on two backends: a fingerprint of the id -> token map.

Each tokenizer's own ``fingerprint`` hashes what it is built from (transformers: the Hugging Face vocabulary with
its ``▁``/byte-level spellings; llama.cpp: llama.cpp's pieces and token attributes), so the same vocabulary
converted to GGUF gets another one. A state's ids can still move between the two models when every id stands for
the same thing, which is what this fingerprint hashes, computed alike by both tokenizers:

* every id's **bytes** (what the id adds to a row's text);
* for an id without bytes (control tokens: llama.cpp gives them none; BOS/EOS/pad/unknown, chat markers), its
  **name** (``"<s>"``, ``"<start_of_turn>"``) instead, so two control tokens cannot trade places unnoticed;
* the **BOS id** and the **end-of-generation ids** (they decide where a row starts and whether it is finished).

Equal id fingerprints mean a state's token ids can be recomputed by the other model (never its KV: that is
``same_model``'s question). Tokenization is not compared (two tokenizers of one vocabulary may split a new text
differently); the ids already in a state are what moves.

Example:
    >>> hf_model.tokenizer.ids_fingerprint == gguf_model.tokenizer.ids_fingerprint   # doctest: +SKIP
    True
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence

__all__ = ["id_map_fingerprint"]


def id_map_fingerprint(vocab_bytes: Sequence[bytes | None], name: Callable[[int], str | None],
                       bos_id: int | None, eos_ids: Iterable[int]) -> str:
    """The fingerprint of an id -> token map (see the module docstring).

    Args:
        vocab_bytes: the bytes of every id (``None``: an id without bytes, a special or control token).
        name: the text of an id without bytes (its name in the vocabulary), or ``None`` if it has none.
        bos_id: the beginning-of-sequence id (``None``: none).
        eos_ids: every end-of-generation id.
    """
    h = hashlib.sha256(f"idmap1;{len(vocab_bytes)};{bos_id};{sorted(int(i) for i in eos_ids)};".encode())
    for idx, data in enumerate(vocab_bytes):
        if data is None:  # a special token: its name, marked so that it cannot equal a normal token's bytes
            h.update(b"\x00S" + (name(idx) or "").encode("utf-8", "replace") + b"\x00")
        else:
            h.update(b"\x00B" + len(data).to_bytes(4, "little") + data)
    return h.hexdigest()[:16]
