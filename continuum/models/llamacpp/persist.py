"""A llama.cpp state's KV in a state file: each distinct sequence's bytes once, behind continuum's fingerprint.

``state.save(path)`` writes, besides the tokens (``continuum/state/persistence.py``), for a :class:`~.seqkv.SeqKV`:

* ``kvh.blob{j}``: sequence ``j``'s bytes (``llama_state_seq_get_data`` of the longest row viewing it), packed with
  the model's fingerprint (``fingerprint.pack``: GGUF hash, KV type, flash attention, mode, llama.cpp version);
  rows that view the same sequence share one blob. A sliding-window model writes only the window behind a
  sequence's end, so there each distinct (sequence, length) gets its own blob;
* ``kvh.rows``: per row, its blob (-1: no KV) and how many positions it sees; ``kvh.cols``: the layout's cached
  columns (``SeqKV.cols``);
* in the metadata, the SHA-256 of every blob: bytes damaged on disk are refused, never loaded into cells
  (llama.cpp checks the layout, not the values).

:func:`load_kv` restores each blob into a fresh sequence (no token recomputed) and gives every row its view. It
raises :class:`~continuum.errors.ForeignStateError` (another model or setting), :class:`~continuum.errors.StateFileError`
(damaged) or :class:`~continuum.errors.BackendError` (llama.cpp refused the bytes); the caller then drops the KV
with a warning and the state is recomputed in one pass.

Example:
    >>> tensors, meta = save_kv(model, state._kv)            # doctest: +SKIP
    >>> kv = load_kv(model, tensors, meta)                   # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ...errors import StateFileError
from .fingerprint import pack, unpack
from .seqkv import SeqKV
from .sequences import KVView

__all__ = ["save_kv", "load_kv"]

PREFIX = "kvh."


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def save_kv(model: Any, kv: SeqKV) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors (names under ``"kvh."``) and metadata that store ``kv`` (see the module docstring)."""
    window = model.llama.n_swa > 0  # a blob holds the window behind its end only: one per (sequence, length)
    keys: list[Any] = []
    longest: dict[Any, KVView] = {}
    for v in kv.views:
        seq = getattr(v, "seq", None)
        key = None if seq is None or v.n_tokens == 0 else ((id(seq), v.n_tokens) if window else id(seq))
        keys.append(key)
        if key is not None and (key not in longest or v.n_tokens > longest[key].n_tokens):
            longest[key] = v
    order = {key: j for j, key in enumerate(longest)}
    tensors: dict[str, torch.Tensor] = {}
    digests = []
    for key, j in order.items():
        view = longest[key]
        data = pack(model.llama, model.pool.to_bytes(view), view.n_tokens)
        tensors[f"{PREFIX}blob{j}"] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        digests.append(_digest(data))
    rows = [(order[k], v.n_tokens) if k is not None else (-1, 0) for k, v in zip(keys, kv.views)]
    tensors[f"{PREFIX}rows"] = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 2)
    tensors[f"{PREFIX}cols"] = kv.cols.to(torch.uint8).cpu()
    return tensors, {"backend": "llamacpp", "blobs": len(digests), "sha256": digests}


def load_kv(model: Any, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> SeqKV:
    """The :class:`SeqKV` that :func:`save_kv` stored, restored into fresh sequences of ``model`` (see the module
    docstring for what it raises)."""
    if meta.get("backend") != "llamacpp":
        raise StateFileError(f"the file's KV was stored by the {meta.get('backend')!r} backend, not llama.cpp")
    try:
        rows = tensors[f"{PREFIX}rows"].tolist()
        cols = tensors[f"{PREFIX}cols"].bool()
        blobs = [tensors[f"{PREFIX}blob{j}"].numpy().tobytes() for j in range(int(meta["blobs"]))]
        digests = list(meta["sha256"])
    except (KeyError, TypeError, ValueError) as exc:
        raise StateFileError(f"the file's llama.cpp KV is incomplete ({exc})") from exc
    if len(digests) != len(blobs) or any(_digest(b) != d for b, d in zip(blobs, digests)):
        raise StateFileError("the file's llama.cpp KV bytes are damaged (their SHA-256 differs from the one saved)")
    if len(rows) != cols.shape[0] or any(n != int(c) for (_, n), c in zip(rows, cols.sum(1).tolist())):
        raise StateFileError("the file's llama.cpp KV rows do not match its cached columns")
    views: list[KVView] = []
    restored: dict[int, KVView] = {}
    try:
        for j, data in enumerate(blobs):
            blob, n = unpack(model.llama, data)  # another GGUF/setting: ForeignStateError, before any cell is touched
            if n != max((m for b, m in rows if b == j), default=0):
                raise StateFileError(f"the file's llama.cpp KV blob {j} holds {n} positions, not its longest row's")
            restored[j] = model.pool.from_bytes(blob, n)
        for j, n in rows:
            if j < 0:
                views.append(model.pool.empty())
            elif j not in restored:
                raise StateFileError(f"a row of the file's llama.cpp KV names blob {j}, which is not there")
            else:
                views.append(restored[j] if n == restored[j].n_tokens else restored[j].slice(n))
    except BaseException:
        for v in [*views, *restored.values()]:
            v.release()
        raise
    return SeqKV(views, cols)
