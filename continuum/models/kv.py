"""The KV cache as the decoding loop and the state algebra see it, whatever the backend.

A state's KV covers columns ``[0, length)`` of its rows' layout (left padding and holes included: column
``j`` of the KV is column ``j`` of the state's tokens). What it is depends on the model's backend:

* transformers (:mod:`continuum.models.hf.cache`): a plain tuple ``((keys, values), ...)`` of torch tensors, one
  pair per layer, or a lazy view of the engine's merged storage (a ``Sequence`` of such pairs);
* any other backend: an object implementing :class:`KVHandle` (its own storage, e.g. a llama.cpp sequence per row).

The loop, the engine and ``state/`` call only the functions below; each hands a handle its own method and a
tensor tuple to the transformers code. Every operation returns a new KV and never changes what another state
sees (invariant 2): a backend whose storage is shared (llama.cpp's cells) copies on write or forks.

Example:
    >>> from continuum.models import kv
    >>> kv.length(state._kv), kv.nbytes(state._kv)                  # doctest: +SKIP
    (12, 24576)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .hf import cache as _hf
from .hf.cache import RESERVE_CAP, positions
from .hf.slab import slot_of

__all__ = ["KVHandle", "KV", "is_handle", "length", "select_rows", "crop", "keep", "narrow", "finish", "compact", "stack_rows",
           "nbytes", "gather_paths", "dtype", "devices", "to_devices", "positions", "RESERVE_CAP"]

KV = Any  # a tensor tuple (transformers), a KVHandle (other backends), or None (nothing cached)


@runtime_checkable
class KVHandle(Protocol):
    """The KV of a batch of rows held by a backend's own storage: what a backend other than transformers implements.

    Rows are in the state's order; ``length()`` columns of the layout are covered. Handles are values: no method
    changes ``self`` or anything another handle sees.
    """

    def length(self) -> int:
        """Columns of the rows' layout the KV covers."""
        ...

    def select_rows(self, rows: torch.Tensor) -> KVHandle:
        """The rows ``rows`` (a 1-D index, repeats allowed: forks and beams), in that order."""
        ...

    def crop(self, columns: int) -> KVHandle | None:
        """The first ``columns`` columns (``None`` when 0)."""
        ...

    def keep(self, mask: torch.Tensor) -> KVHandle:
        """Only the columns ``mask`` (bool ``(rows, length)``) marks real: no row attends to the others."""
        ...

    def narrow(self, rows: int, lead: int) -> KVHandle:
        """The first ``rows`` rows without their first ``lead`` columns (masked in those rows)."""
        ...

    def settle(self) -> KVHandle:
        """The KV a finished call hands to its result state: storage it no longer needs given back."""
        ...

    def nbytes(self, seen: set | None = None) -> int:
        """Bytes of storage held, storage shared with handles already in ``seen`` counted once."""
        ...

    @classmethod
    def stack(cls, kvs: list[KVHandle], width: int, reserve: int = 0) -> KVHandle:
        """The rows of ``kvs`` one after another, each right-aligned to ``width`` columns."""
        ...


def _handle(kv: Any) -> bool:
    # (a tuple first: the Sequence ABC's isinstance is slow, and this runs many times per call and step)
    return kv is not None and type(kv) is not tuple and not isinstance(kv, Sequence)


def is_handle(kv: KV) -> bool:
    """True for a backend's own KV (a :class:`KVHandle`), False for transformers' tensors or ``None``."""
    return _handle(kv)


def length(kv: KV) -> int:
    """Columns covered (0 for ``None``)."""
    return kv.length() if _handle(kv) else _hf.length(kv)


def select_rows(kv: KV, rows: torch.Tensor) -> KV:
    """Rows ``rows`` of ``kv``, in that order (forks, beams, slicing the batch)."""
    return kv.select_rows(rows) if _handle(kv) else _hf.select_rows(kv, rows)


def crop(kv: KV, columns: int) -> KV:
    """The first ``columns`` columns of ``kv``."""
    return kv.crop(columns) if _handle(kv) else _hf.crop(kv, columns)


def keep(kv: KV, mask: torch.Tensor) -> KV:
    """``kv`` where only the columns ``mask`` (``(rows, length)``) marks real are attended to: a state that cut
    cached tokens (``state[..., :n]`` keeps a different count per row). Transformers attends by the attention mask,
    so its tensors stay, as new views: the old ones may be a merged slab's rows, and the slab keeps its rows' mask
    from step to step (a continuation taken for a slab member in place would attend to the cut columns through it);
    a handle cuts its storage's views (llama.cpp attends to every cell of a view)."""
    if _handle(kv):
        return kv.keep(mask)
    return None if kv is None else tuple((k.narrow(2, 0, k.shape[2]), v.narrow(2, 0, v.shape[2])) for k, v in kv)


def narrow(kv: KV, rows: int, lead: int) -> KV:
    """The first ``rows`` rows of ``kv`` without their first ``lead`` columns (CFG's conditional rows in a batch of
    both branches, behind the masked columns that right-align them with the unconditional ones)."""
    if _handle(kv):
        return kv.narrow(rows, lead)
    return tuple((k[:rows, :, lead:], v[:rows, :, lead:]) for k, v in kv)


def finish(kv: KV, columns: int) -> KV:
    """What a finished call hands to its result state: its first ``columns`` columns, in storage of its own when
    they were a view of the engine's merged storage (a small part of it must not pin the rest), else with the
    room allocated ahead given back."""
    if _handle(kv):
        out = kv.crop(columns)
        return None if out is None else out.settle()
    merged = slot_of(kv) is not None
    out = _hf.crop(tuple(kv) if kv is not None else None, columns)  # (the engine's lazy views are made here)
    return _hf.compact(out) if merged else _hf.shrink(out)


def compact(kv: KV) -> KV:
    """``kv`` in storage of its own when it is a small part of a bigger one (a slice must not pin the rest)."""
    return kv.settle() if _handle(kv) else _hf.compact(kv)


def stack_rows(kvs: list[KV], width: int, reserve: int = 0) -> KV:
    """The rows of ``kvs`` one after another, each right-aligned to ``width`` columns."""
    if any(_handle(k) for k in kvs):
        return type(next(k for k in kvs if _handle(k))).stack(kvs, width, reserve)
    return _hf.stack_rows(kvs, width, reserve)


def gather_paths(kv: KV, rows: torch.Tensor, start: int, split: int, index: torch.Tensor, mask: torch.Tensor) -> KV:
    """Choice scoring's chosen pairs from a token tree's KV: for each output row ``j``, the columns ``[start, split)``
    of row ``rows[j]`` followed by its tree columns ``split + index[j, i]``; ``mask`` ``(len(rows), split - start +
    index.shape[1])`` says which of those columns are real (holes on the left of shorter paths are masked). ``kv``
    is only read. Transformers copies the columns into new storage; a handle (llama.cpp) picks views of the
    sequences that hold each path."""
    if _handle(kv):
        return kv.gather_paths(rows, start, split, index, mask)
    return _hf.gather_paths(kv, rows, start, split, index)


def nbytes(kv: KV, seen: set | None = None) -> int:
    """Bytes of storage ``kv`` holds, shared storage counted once."""
    return kv.nbytes(seen) if _handle(kv) else _hf.nbytes(kv, seen)


def dtype(kv: KV) -> torch.dtype | None:
    """The dtype of the KV tensors (``None`` for a handle or no KV: the backend keeps its own types)."""
    return None if kv is None or _handle(kv) else kv[0][0].dtype


def devices(kv: KV) -> tuple[torch.device, ...] | None:
    """The device of each layer's tensors (``None`` for a handle: its storage is the backend's)."""
    return None if _handle(kv) else _hf.devices(kv)


def to_devices(kv: KV, where: tuple[torch.device, ...] | None) -> KV:
    """``kv`` with each layer on its device (a handle stays where its backend keeps it)."""
    return kv if _handle(kv) or where is None else _hf.to_devices(kv, where)
