"""Merged KV storage: a :class:`Slab` (one preallocated key/value tensor per layer, its merged mask) and
the lazy view of one request's rows in it (:class:`SlabView`); :func:`slot_of` tells where a cache sits.
The layout itself (who goes where, when a slab is re-laid out) is :mod:`continuum.models.hf.merge`'s."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import cache as kvcache

__all__ = ["Slab", "SlabView", "slot_of"]


class Slab:
    """Merged KV storage (see the module docstring); allocated layer by layer on first use. ``mask``
    is the merged attention mask of its rows, kept from step to step: a member's cached columns are
    written once, when it joins, and each step adds only the new columns."""

    def __init__(self, layers: int, rows_cap: int, cols_cap: int):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.mask: torch.Tensor | None = None
        self.rows_cap, self.cols_cap = rows_cap, cols_cap
        self.rows_used = 0  # rows [0, rows_used) have been handed out (live or dead); the rest never were
        self.end = 0  # columns [0, end) are written; the next step writes at end

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)


class SlabView(Sequence):
    """One request's KV in a slab, ``((keys, values), ...)`` like any cache, its per-layer views made on
    first use: a running call hands it straight back to the next step, which needs only its slot
    (no view is made per call per step). The slab's storage never moves and its written columns never
    change (copy-on-write), so a view made late holds what one made at once would."""

    __slots__ = ("_kv", "slot", "width")

    def __init__(self, slot: tuple[Slab, int, int, int], width: int):
        self.slot, self.width = slot, width  # (slab, first row, rows, first column), columns
        self._kv: kvcache.KV | None = None

    def materialize(self) -> kvcache.KV:
        if self._kv is None:
            slab, row, rows, start = self.slot
            self._kv = tuple((K.narrow(0, row, rows).narrow(2, start, self.width),
                              V.narrow(0, row, rows).narrow(2, start, self.width))
                             for K, V in zip(slab.keys, slab.values) if K is not None and V is not None)
            self._kv[0][0]._continuum_slot = self.slot  # type: ignore[attr-defined]
        return self._kv

    def __getitem__(self, i):
        return self.materialize()[i]

    def __len__(self) -> int:
        return len(self.slot[0].keys)

    def __iter__(self):
        return iter(self.materialize())


def slot_of(kv: kvcache.KV | SlabView | None) -> tuple[Slab, int, int, int] | None:
    """``(slab, first row, row count, first column)`` when ``kv`` is a view a merged forward handed out."""
    if kv is None:
        return None
    if isinstance(kv, SlabView):
        return kv.slot
    return getattr(kv[0][0], "_continuum_slot", None)
