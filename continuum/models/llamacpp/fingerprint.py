"""What a llama.cpp KV blob is valid for, and the envelope that refuses one from elsewhere.

llama.cpp's per-sequence bytes record neither the weights nor the architecture: loaded into another model of the
same shape they are accepted and give wrong logits. So continuum wraps them with a fingerprint of

* the GGUF (its size and a SHA-256 of its first 4 MiB, 32 evenly spaced 64 KiB blocks and its last 1 MiB: the
  header, metadata and tokenizer entirely, and samples of every region of the weights; computed once per file),
* the KV cache's type and the flash-attention setting (they set the blob's layout: V is stored transposed
  without flash attention), the unified cache, and the batch-invariant mode (it changes the kernels, hence the
  cells' values),
* the llama-cpp-python version (it pins the llama.cpp commit, whose blob format may change).

:func:`unpack` of bytes packed under any other fingerprint raises :class:`~continuum.errors.ForeignStateError`:
the caller recomputes the state from its tokens.

Example:
    >>> data = pack(model, pool.to_bytes(view), view.n_tokens)     # doctest: +SKIP
    >>> blob, n = unpack(model, data)                              # doctest: +SKIP
    >>> view2 = pool.from_bytes(blob, n)                           # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, fields
from pathlib import Path

from ...errors import ForeignStateError, StateFileError
from ._lib import version
from .model import LlamaCppModel

__all__ = ["LlamaCppFingerprint", "gguf_hash", "fingerprint_of", "pack", "unpack"]

_MAGIC = b"CNTLLKV1"
_HEAD, _TAIL, _BLOCK, _SAMPLES = 4 << 20, 1 << 20, 64 << 10, 32
_HASHES: dict[tuple[str, int, int], str] = {}


def gguf_hash(path: str | os.PathLike) -> str:
    """A cheap content hash of a GGUF file (see the module docstring), cached per path, size and mtime."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256(str(st.st_size).encode() + b";")
        with p.open("rb") as f:
            h.update(f.read(_HEAD))
            if st.st_size > _HEAD + _TAIL:
                span = st.st_size - _HEAD - _TAIL
                for i in range(_SAMPLES):
                    f.seek(_HEAD + span * i // _SAMPLES)
                    h.update(f.read(_BLOCK))
            f.seek(max(0, st.st_size - _TAIL))
            h.update(f.read(_TAIL))
        _HASHES[key] = h.hexdigest()[:32]
    return _HASHES[key]


@dataclass(frozen=True)
class LlamaCppFingerprint:
    """What a llama.cpp KV blob was computed with (see the module docstring)."""

    gguf: str
    kv_type: str
    flash_attn: bool
    kv_unified: bool
    batch_invariant: bool
    llama_cpp: str

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # (flat values: no deep copy, models/identity.py)


def fingerprint_of(model: LlamaCppModel) -> LlamaCppFingerprint:
    """The fingerprint of ``model``'s KV blobs (computed once per model)."""
    fp = model.kv_fingerprint
    if fp is None:
        fp = LlamaCppFingerprint(gguf=gguf_hash(model.path), kv_type=model.kv_type, flash_attn=model.flash_attn,
                                 kv_unified=True, batch_invariant=model.batch_invariant, llama_cpp=version())
        model.kv_fingerprint = fp
    return fp


def pack(model: LlamaCppModel, blob: bytes, n_tokens: int) -> bytes:
    """``blob`` (``SequencePool.to_bytes``) of ``n_tokens`` positions, behind ``model``'s fingerprint."""
    head = json.dumps({"fingerprint": fingerprint_of(model).as_dict(), "n_tokens": int(n_tokens)}).encode()
    return _MAGIC + struct.pack("<I", len(head)) + head + blob


def unpack(model: LlamaCppModel, data: bytes) -> tuple[bytes, int]:
    """``(blob, n_tokens)`` of :func:`pack` output, if it was packed under ``model``'s fingerprint.

    Raises:
        StateFileError: not bytes made by :func:`pack` (truncated, another format).
        ForeignStateError: packed for another GGUF, KV layout, mode or llama.cpp version (the message says which).
    """
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 4:
        raise StateFileError("not a continuum llama.cpp KV blob (bad magic): recompute the state from its tokens")
    (size,) = struct.unpack_from("<I", data, len(_MAGIC))
    start = len(_MAGIC) + 4
    try:
        head = json.loads(data[start:start + size])
        saved, n_tokens = head["fingerprint"], int(head["n_tokens"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StateFileError(f"a corrupt continuum llama.cpp KV blob ({exc}): recompute the state from its tokens") from exc
    mine = fingerprint_of(model).as_dict()
    differ = [k for k in mine if saved.get(k) != mine[k]]
    if differ:
        what = ", ".join(f"{k} {saved.get(k)!r} (this model: {mine[k]!r})" for k in differ)
        raise ForeignStateError(f"this KV blob was made with {what}: its cells would give wrong logits here; "
                                "recompute the state from its tokens")
    return data[start + size:], n_tokens
