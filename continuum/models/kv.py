"""The KV cache as the decoding loop and the state algebra see it, whatever the backend.

A state's KV covers columns ``[0, length)`` of its rows' layout (left padding and holes included: column
``j`` of the KV is column ``j`` of the state's tokens). Every backend's KV is a handle (:class:`KVHandle`), or
``None`` when nothing is cached:

* transformers: :class:`~continuum.models.hf.tensorkv.TensorKV`, per-layer ``(keys, values)`` torch tensors (or
  the lazy view of the engine's merged storage); a hybrid model's :class:`~continuum.models.hf.recurrent.HybridKV`;
* llama.cpp: :class:`~continuum.models.llamacpp.seqkv.SeqKV`, views on the model's sequences;
* a remote model: :class:`~continuum.models.remote.handle.RemoteKV`, the server's stored state.

The loop, the engine and ``state/`` call only the functions below, each the handle's own method (``None`` handled
here). Code that works on the tensors themselves asks for them (:func:`tensors`: None for a backend's own storage).
Every operation returns a new KV and never changes what another state sees (invariant 2): a backend whose storage is
shared (llama.cpp's cells) copies on write or forks.

Example:
    >>> from continuum.models import kv
    >>> kv.length(state._kv), kv.nbytes(state._kv)                  # doctest: +SKIP
    (12, 24576)
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["KVHandle", "KV", "tensors", "from_tensors", "opaque", "length", "select_rows", "crop", "keep", "narrow", "rows",
           "finish", "compact", "stack_rows", "nbytes", "gather_paths", "dtype", "devices", "to_devices", "positions",
           "RESERVE_CAP"]

KV = Any  # a KVHandle, or None (nothing cached)

RESERVE_CAP = 1024  # KV columns allocated ahead at most (an open-ended generation grows in chunks)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of every column of a token matrix: the number of real tokens before it (holes and
    padding do not count), as the KV's column layout needs them."""
    return (mask.cumsum(1) - 1).clamp(min=0)


@runtime_checkable
class KVHandle(Protocol):
    """The KV of a batch of rows, whatever holds it: what every backend implements.

    Rows are in the state's order; ``length()`` columns of the layout are covered. Handles are values: no method
    changes ``self`` or anything another handle sees. Optional methods, used where a handle has them: ``tensors()``
    (torch tensors, :func:`tensors`), ``finish(columns)`` (:func:`finish`), ``dtype()``, ``devices()``,
    ``to_devices(where)``.
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


def tensors(kv: KV) -> Any:
    """The KV as per-layer ``(keys, values)`` torch tensors (a transformers state's: state files, the server's stored
    parts, rows realigned or views taken of them), or None for a backend's own storage (llama.cpp's cells) or no KV."""
    get = getattr(kv, "tensors", None)
    return None if get is None else get()


def from_tensors(model: Any, layers: Any) -> KV:
    """``model``'s KV over per-layer ``(keys, values)`` tensors (read from a file, or laid out anew), each layer on
    its layer's device; None for no tensors, or a backend whose KV is not torch tensors."""
    make = getattr(model, "kv_from_tensors", None)
    return None if layers is None or make is None else make(layers)


def opaque(kv: KV) -> bool:
    """True for a KV whose storage is the backend's own (llama.cpp's sequences, a hybrid's snapshots, a remote
    handle): no torch tensors one can view or save (:func:`tensors`); False for transformers' tensors or ``None``."""
    return kv is not None and getattr(kv, "tensors", None) is None


def length(kv: KV) -> int:
    """Columns covered (0 for ``None``)."""
    return 0 if kv is None else kv.length()


def select_rows(kv: KV, rows: torch.Tensor) -> KV:
    """Rows ``rows`` of ``kv``, in that order (forks, beams, slicing the batch)."""
    return None if kv is None else kv.select_rows(rows)


def crop(kv: KV, columns: int) -> KV:
    """The first ``columns`` columns of ``kv``."""
    return None if kv is None else kv.crop(columns)


def keep(kv: KV, mask: torch.Tensor) -> KV:
    """``kv`` where only the columns ``mask`` (``(rows, length)``) marks real are attended to: a state that cut
    cached tokens (``state[..., :n]`` keeps a different count per row). Transformers attends by the attention mask,
    so its tensors stay, as new views: the old ones may be a merged slab's rows, and the slab keeps its rows' mask
    from step to step (a continuation taken for a slab member in place would attend to the cut columns through it);
    llama.cpp cuts its storage's views (it attends to every cell of a view)."""
    return None if kv is None else kv.keep(mask)


def narrow(kv: KV, rows: int, lead: int) -> KV:
    """The first ``rows`` rows of ``kv`` without their first ``lead`` columns (CFG's conditional rows in a batch of
    both branches, behind the masked columns that right-align them with the unconditional ones)."""
    return kv.narrow(rows, lead)


def rows(kv: KV, start: int, n: int, lead: int) -> KV:
    """Rows ``start .. start+n-1`` of ``kv`` without their first ``lead`` columns (a joint call's caller's rows: views
    where the backend's storage allows, one slice per tensor on transformers)."""
    own = getattr(kv, "rows", None)
    if own is not None:
        return own(start, n, lead)
    return narrow(select_rows(kv, torch.arange(start, start + n)), n, lead)


def split_rows(kv: KV, spans: list[tuple[int, int, int]], own: list[bool]) -> list[KV]:
    """:func:`rows` for each ``(start, n, lead)`` of ``spans`` (a joint call's callers), each marked ``own`` in
    storage that does not keep the others' rows alive (:func:`compact`; a backend may copy them all at once)."""
    split = getattr(kv, "split_rows", None)
    if split is not None:
        return split(spans, own)
    out = [rows(kv, *span) for span in spans]
    return [compact(k) if o else k for k, o in zip(out, own)]


def row_span(kv: KV) -> tuple[Any, int, int] | None:
    """``(tensors, first row, first column)``: where a transformers cache's rows and columns lie (the parent a lazy
    row view reads, or its own tensors from ``(0, 0)``); None for a backend without tensors."""
    own = getattr(kv, "row_span", None)
    return None if own is None else own()


def finish(kv: KV, columns: int) -> KV:
    """What a finished call hands to its result state: its first ``columns`` columns, with the storage it no longer
    needs given back (a handle's own ``finish`` where it has one: transformers copies a small part of the engine's
    merged storage out, so it does not pin the rest; else ``crop`` then ``settle``)."""
    if kv is None:
        return None
    own = getattr(kv, "finish", None)
    if own is not None:
        return own(columns)
    out = kv.crop(columns)
    return None if out is None else out.settle()


def compact(kv: KV) -> KV:
    """``kv`` in storage of its own when it is a small part of a bigger one (a slice must not pin the rest)."""
    return None if kv is None else kv.settle()


def stack_rows(kvs: list[KV], width: int, reserve: int = 0) -> KV:
    """The rows of ``kvs`` one after another, each right-aligned to ``width`` columns."""
    return type(next(k for k in kvs if k is not None)).stack(kvs, width, reserve)


def gather_paths(kv: KV, rows: torch.Tensor, start: int, split: int, index: torch.Tensor, mask: torch.Tensor) -> KV:
    """Choice scoring's chosen pairs from a token tree's KV: for each output row ``j``, the columns ``[start, split)``
    of row ``rows[j]`` followed by its tree columns ``split + index[j, i]``; ``mask`` ``(len(rows), split - start +
    index.shape[1])`` says which of those columns are real (holes on the left of shorter paths are masked). ``kv``
    is only read. Transformers copies the columns into new storage; llama.cpp picks views of the sequences that
    hold each path."""
    return None if kv is None else kv.gather_paths(rows, start, split, index, mask)


def nbytes(kv: KV, seen: set | None = None) -> int:
    """Bytes of storage ``kv`` holds, shared storage counted once."""
    return 0 if kv is None else kv.nbytes(seen)


def dtype(kv: KV) -> torch.dtype | None:
    """The dtype of the KV tensors (``None`` for no KV or a handle whose backend keeps its own types)."""
    own = getattr(kv, "dtype", None)
    return None if own is None else own()


def devices(kv: KV) -> tuple[torch.device, ...] | None:
    """The device of each layer's tensors (``None``: no KV, or storage a backend keeps where it keeps it)."""
    own = getattr(kv, "devices", None)
    return None if own is None else own()


def to_devices(kv: KV, where: tuple[torch.device, ...] | None) -> KV:
    """``kv`` with each layer on its device (a handle without tensors stays where its backend keeps it)."""
    own = getattr(kv, "to_devices", None)
    return kv if own is None or where is None else own(where)
