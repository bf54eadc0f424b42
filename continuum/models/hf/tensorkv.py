"""A transformers state's KV as the backend protocol's handle (:class:`~continuum.models.kv.KVHandle`), like
llama.cpp's sequence views (``models/llamacpp/seqkv.py``) and a hybrid model's :class:`~.recurrent.HybridKV`.

:class:`TensorKV` holds the per-layer ``(keys, values)`` tensors of a batch of rows (:mod:`.cache`: arenas,
copy-on-write views), or the lazy view of the engine's merged storage a running call gets back from a step
(:class:`~.slab.SlabView`: no per-layer views made per call per step), or the lazy view of some rows of another
cache a joint call's caller gets back (:class:`Rows`: no per-layer views made per caller; stacking them again gathers
from the parent directly, ``state/stacking.py``). Its methods are :mod:`.cache`'s functions;
the loop, the engine and ``state/`` reach them through :mod:`continuum.models.kv` like any backend's, and code that
works on the tensors themselves (state files, the server's stored parts, realigning rows) asks for them by name
(:meth:`TensorKV.tensors`, ``kv.tensors(kv)``). Inside ``models/hf/`` the forward, the merged step and the prefix
cache work on the tensors (:func:`layers_of` at their entry, :func:`wrap` at their exit).

Example:
    >>> kv = state._kv                      # a models.transformers state          # doctest: +SKIP
    >>> kv.length(), kv.crop(3).length(), len(kv.tensors())                        # doctest: +SKIP
    (12, 3, 2)
"""

from __future__ import annotations

from typing import Any

import torch

from . import cache as _hf
from .slab import SlabView, slot_of

__all__ = ["TensorKV", "wrap", "layers_of"]


class Rows:
    """Rows ``start .. start+n-1`` of ``parent`` (a ``((keys, values), ...)`` tuple), columns ``lead .. end-1``, its
    per-layer views made on first use. A joint call hands each of its 128 callers its rows (``loop/coalesce``); made
    at once, those were ten views per caller on stories260K, and the next joint call stacked them back without
    looking at most of them (B22b). ``parent`` never changes (copy-on-write), so a view made late holds what one
    made at once would."""

    __slots__ = ("parent", "start", "n", "lead", "end", "_kv")

    def __init__(self, parent: _hf.KV, start: int, n: int, lead: int, end: int):
        self.parent, self.start, self.n, self.lead, self.end = parent, start, n, lead, end
        self._kv: _hf.KV | None = None

    def materialize(self) -> _hf.KV:
        if self._kv is None:
            a, b, c, d = self.start, self.start + self.n, self.lead, self.end
            self._kv = tuple((k[a:b, :, c:d], v[a:b, :, c:d]) for k, v in self.parent)
        return self._kv


class TensorKV:
    """The KV tensors of a batch of rows (see the module docstring). A value: every method returns a new handle
    (or ``self`` where nothing changes) and never writes a tensor another handle can see."""

    __slots__ = ("_layers",)

    def __init__(self, layers: _hf.KV | SlabView | Rows):
        self._layers = layers

    def __repr__(self) -> str:
        lazy = {SlabView: " (merged storage)", Rows: " (rows of another)"}.get(type(self._layers), "")
        return f"TensorKV(layers={len(self._source())}, columns={self.length()}{lazy})"

    def __reduce__(self):
        return (TensorKV, (self.tensors(),))  # (a lazy view pickles as its tensors: the slab stays here)

    # -- what the tensors are -----------------------------------------------------------------------------------
    def tensors(self) -> _hf.KV:
        """The ``((keys, values), ...)`` tuple, one pair per layer, each ``(rows, heads, columns, head_dim)``."""
        layers = self._layers
        return layers if type(layers) is tuple else layers.materialize()  # type: ignore[union-attr]

    def _source(self) -> _hf.KV:
        """Tensors on the same devices, of the same dtype (a lazy row view's parent: nothing materialised)."""
        layers = self._layers
        return layers.parent if type(layers) is Rows else self.tensors()

    def dtype(self) -> torch.dtype:
        return self._source()[0][0].dtype

    def devices(self) -> tuple[torch.device, ...] | None:
        return _hf.devices(self._source())

    def row_span(self) -> tuple[_hf.KV, int, int]:
        """``(tensors, first row, first column)`` where this cache's rows and columns lie: a lazy row view's parent
        and place in it, else its own tensors from ``(0, 0)`` (``state/stacking.kv_layers`` gathers from there)."""
        layers = self._layers
        if type(layers) is Rows:
            return layers.parent, layers.start, layers.lead
        return self.tensors(), 0, 0

    def to_devices(self, where: tuple[torch.device, ...]) -> TensorKV:
        layers = self.tensors()
        out = _hf.to_devices(layers, where)
        return self if out is layers else TensorKV(out)  # type: ignore[arg-type]

    # -- the protocol ------------------------------------------------------------------------------------------
    def length(self) -> int:
        layers = self._layers
        if isinstance(layers, Rows):
            return layers.end - layers.lead
        return layers.width if isinstance(layers, SlabView) else _hf.length(layers)  # (a lazy view knows its width)

    def select_rows(self, rows: torch.Tensor) -> TensorKV:
        return TensorKV(_hf.select_rows(self.tensors(), rows))  # type: ignore[arg-type]

    def crop(self, columns: int) -> TensorKV | None:
        layers = self._layers
        if type(layers) is Rows and columns > 0:  # (still lazy: text appended to a joint call's rows keeps them so)
            if columns >= layers.end - layers.lead:
                return self
            return TensorKV(Rows(layers.parent, layers.start, layers.n, layers.lead, layers.lead + columns))
        return wrap(_hf.crop(self.tensors(), columns))

    def keep(self, mask: torch.Tensor) -> TensorKV:
        """The same tensors, as new views: transformers attends by the attention mask (``kv.keep``)."""
        return TensorKV(tuple((k.narrow(2, 0, k.shape[2]), v.narrow(2, 0, v.shape[2])) for k, v in self.tensors()))

    def narrow(self, rows: int, lead: int) -> TensorKV:
        return TensorKV(tuple((k[:rows, :, lead:], v[:rows, :, lead:]) for k, v in self.tensors()))

    def rows(self, start: int, n: int, lead: int) -> TensorKV:
        """Rows ``start .. start+n-1`` without their first ``lead`` columns: a lazy view (:class:`Rows`)."""
        layers = self._layers
        if type(layers) is Rows:
            return TensorKV(Rows(layers.parent, layers.start + start, n, layers.lead + lead, layers.end))
        return TensorKV(Rows(self.tensors(), start, n, lead, self.length()))

    def split_rows(self, spans: list[tuple[int, int, int]], own: list[bool]) -> list[TensorKV]:
        """:meth:`rows` for each ``(start, n, lead)`` of ``spans``; those marked ``own`` in storage of their own,
        shared by them only and made by ONE gather per tensor (a short caller must not keep the joint call's long
        rows alive; copied one by one, that was ~0.1 ms per caller)."""
        if type(self._layers) is Rows:
            out = [self.rows(*span) for span in spans]
        else:  # (the joint call's own tensors: read once for all callers)
            parent, end = self.tensors(), self.length()
            out = [TensorKV(Rows(parent, start, n, lead, end)) for start, n, lead in spans]
        mine = [i for i, o in enumerate(own) if o]
        if not mine:
            return out
        layers, C = self.tensors(), self.length()
        m = min(spans[i][2] for i in mine)
        index = torch.cat([torch.arange(spans[i][0], spans[i][0] + spans[i][1]) for i in mine])
        on = _hf._per_device(index)
        copied = tuple((k[:, :, m:].index_select(0, on(k.device)), v[:, :, m:].index_select(0, on(k.device)))
                       for k, v in layers)
        row = 0
        for i in mine:
            _, n, lead = spans[i]
            out[i] = TensorKV(Rows(copied, row, n, lead - m, C - m))
            row += n
        return out

    def settle(self) -> TensorKV:
        """Storage of its own when it is a small part of a bigger one (``cache.compact``)."""
        layers = self.tensors()
        out = _hf.compact(layers)
        return self if out is layers else TensorKV(out)  # type: ignore[arg-type]

    def finish(self, columns: int) -> TensorKV | None:
        """What a finished call hands to its result state: its first ``columns`` columns, in storage of its own when
        they were a view of the engine's merged storage (a small part of it must not pin the rest), else with the
        room allocated ahead given back (``cache.shrink``)."""
        # (asked before the crop: a cropped view no longer says where it sat)
        merged = not isinstance(self._layers, Rows) and slot_of(self._layers) is not None
        out = _hf.crop(self.tensors(), columns)
        return wrap(_hf.compact(out) if merged else _hf.shrink(out))

    def nbytes(self, seen: set | None = None) -> int:
        return _hf.nbytes(self.tensors(), seen)

    @classmethod
    def stack(cls, kvs: list, width: int, reserve: int = 0) -> TensorKV:
        return cls(_hf.stack_rows([kv.tensors() for kv in kvs], width, reserve))

    def gather_paths(self, rows: torch.Tensor, start: int, split: int, index: torch.Tensor,
                     mask: torch.Tensor) -> TensorKV | None:
        return wrap(_hf.gather_paths(self.tensors(), rows, start, split, index))


def wrap(layers: Any) -> TensorKV | None:
    """``layers`` (a tuple, a lazy slab view, or None) as a handle (None stays None)."""
    return None if layers is None else TensorKV(layers)


def layers_of(kv: Any) -> Any:
    """The tensors (or lazy slab view) a :class:`TensorKV` holds (a lazy row view's made now); anything else as it
    is (None, a hybrid's handle, a tuple already)."""
    if type(kv) is not TensorKV:
        return kv
    layers = kv._layers
    return layers.materialize() if type(layers) is Rows else layers
