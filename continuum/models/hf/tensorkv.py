"""A transformers state's KV as the backend protocol's handle (:class:`~continuum.models.kv.KVHandle`), like
llama.cpp's sequence views (``models/llamacpp/seqkv.py``) and a hybrid model's :class:`~.recurrent.HybridKV`.

:class:`TensorKV` holds the per-layer ``(keys, values)`` tensors of a batch of rows (:mod:`.cache`: arenas,
copy-on-write views), or the lazy view of the engine's merged storage a running call gets back from a step
(:class:`~.slab.SlabView`: no per-layer views made per call per step). Its methods are :mod:`.cache`'s functions;
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


class TensorKV:
    """The KV tensors of a batch of rows (see the module docstring). A value: every method returns a new handle
    (or ``self`` where nothing changes) and never writes a tensor another handle can see."""

    __slots__ = ("_layers",)

    def __init__(self, layers: _hf.KV | SlabView):
        self._layers = layers

    def __repr__(self) -> str:
        lazy = " (merged storage)" if isinstance(self._layers, SlabView) else ""
        return f"TensorKV(layers={len(self._layers)}, columns={self.length()}{lazy})"

    def __reduce__(self):
        return (TensorKV, (self.tensors(),))  # (a lazy view pickles as its tensors: the slab stays here)

    # -- what the tensors are -----------------------------------------------------------------------------------
    def tensors(self) -> _hf.KV:
        """The ``((keys, values), ...)`` tuple, one pair per layer, each ``(rows, heads, columns, head_dim)``."""
        layers = self._layers
        return layers if type(layers) is tuple else layers.materialize()  # type: ignore[union-attr]

    def dtype(self) -> torch.dtype:
        return self.tensors()[0][0].dtype

    def devices(self) -> tuple[torch.device, ...] | None:
        return _hf.devices(self.tensors())

    def to_devices(self, where: tuple[torch.device, ...]) -> TensorKV:
        layers = self.tensors()
        out = _hf.to_devices(layers, where)
        return self if out is layers else TensorKV(out)  # type: ignore[arg-type]

    # -- the protocol ------------------------------------------------------------------------------------------
    def length(self) -> int:
        layers = self._layers
        return layers.width if isinstance(layers, SlabView) else _hf.length(layers)  # (a lazy view knows its width)

    def select_rows(self, rows: torch.Tensor) -> TensorKV:
        return TensorKV(_hf.select_rows(self.tensors(), rows))  # type: ignore[arg-type]

    def crop(self, columns: int) -> TensorKV | None:
        return wrap(_hf.crop(self.tensors(), columns))

    def keep(self, mask: torch.Tensor) -> TensorKV:
        """The same tensors, as new views: transformers attends by the attention mask (``kv.keep``)."""
        return TensorKV(tuple((k.narrow(2, 0, k.shape[2]), v.narrow(2, 0, v.shape[2])) for k, v in self.tensors()))

    def narrow(self, rows: int, lead: int) -> TensorKV:
        return TensorKV(tuple((k[:rows, :, lead:], v[:rows, :, lead:]) for k, v in self.tensors()))

    def rows(self, start: int, n: int, lead: int) -> TensorKV:
        """Rows ``start .. start+n-1`` without their first ``lead`` columns: one view per tensor."""
        return TensorKV(tuple((k[start:start + n, :, lead:], v[start:start + n, :, lead:]) for k, v in self.tensors()))

    def settle(self) -> TensorKV:
        """Storage of its own when it is a small part of a bigger one (``cache.compact``)."""
        layers = self.tensors()
        out = _hf.compact(layers)
        return self if out is layers else TensorKV(out)  # type: ignore[arg-type]

    def finish(self, columns: int) -> TensorKV | None:
        """What a finished call hands to its result state: its first ``columns`` columns, in storage of its own when
        they were a view of the engine's merged storage (a small part of it must not pin the rest), else with the
        room allocated ahead given back (``cache.shrink``)."""
        merged = slot_of(self._layers) is not None  # (before the crop: a cropped view no longer says where it sat)
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
    """The tensors (or lazy slab view) a :class:`TensorKV` holds; anything else as it is (None, a hybrid's handle,
    a tuple already)."""
    return kv._layers if type(kv) is TensorKV else kv
