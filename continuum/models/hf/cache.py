"""Functional KV-cache operations on transformers' tensors (what :class:`~.tensorkv.TensorKV`, the handle the
rest of continuum holds, runs).

A cache here is a plain tuple ``((keys, values), ...)``, one pair per layer, each tensor of shape
``(rows, heads, columns, head_dim)``. Column ``j`` of the cache holds the keys/values of column
``j`` of the state's token matrix; masked columns (padding, holes) hold values nobody attends to.

Every function returns new tuples and never writes into memory a tensor it was given can see,
so several ``SequenceState`` objects can share tensors (views) safely. Hugging Face ``Cache``
objects mutate in place; :func:`.dynamic.to_dynamic_cache` wraps the tensors in a fresh ``DynamicCache``
for one forward call.

Appending: ``DynamicLayer`` concatenates, copying the whole cache at every decoding step (5-15 %
of a GPT-2-small step on CPU). Our layers write into a preallocated :class:`_Arena` instead and
hand out views of its first columns. Copy-on-write rule: an arena's ``filled`` count only grows
and every view covers at most ``filled`` columns, so appending at ``filled`` (the state that
wrote last, continued again) writes where nobody can look; appending anywhere else (a state cut
back, or continued a second time) starts a new arena.

Devices: every operation keeps each layer's tensors on that layer's device (a model loaded with a
``device_map`` spreading layers over devices has its cache spread the same way); index tensors are
copied to each layer's device once (``_per_device``). Under tensor parallelism a layer holds this
rank's heads only: the operations never look at the head axis, so nothing changes there.
"""

from __future__ import annotations

import functools
import threading

import torch

from ..kv import RESERVE_CAP, positions  # noqa: F401  (the layout's, backend-neutral; here for this backend's modules)

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]

__all__ = ["KV", "positions", "select_rows", "crop", "shrink", "compact",
           "gather_columns", "gather_paths", "nbytes", "length", "stack_rows", "assemble", "devices", "to_devices"]


_MIN_SLACK = 64  # spare columns of a new arena beyond the caller's reserve: the next turn's short append fits


class _Arena:
    """Preallocated key/value storage of one layer, written left to right (see the module docstring)."""

    __slots__ = ("keys", "values", "filled", "_lock")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int):
        self.keys, self.values, self.filled = keys, values, filled
        self._lock = threading.Lock()

    @classmethod
    def allocate(cls, like: torch.Tensor, rows: int, columns: int) -> _Arena:
        shape = (rows, like.shape[1], columns, like.shape[3])
        return cls(like.new_empty(shape), like.new_empty(shape), 0)

    def claim(self, start: int, n: int) -> bool:
        """Reserve columns ``[start, start + n)`` if nobody has written past ``start`` yet."""
        with self._lock:
            if self.filled != start or start + n > self.keys.shape[2]:
                return False
            self.filled = start + n
            return True

    def views(self, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[:, :, :columns], self.values[:, :, :columns]
        # tag the views with their arena (torch tensors take Python attributes; the stubs don't declare this one)
        k._continuum_arena = v._continuum_arena = self  # type: ignore[attr-defined]
        return k, v

    def select_rows(self, rows: torch.Tensor, columns: int) -> _Arena:
        """A new arena of the same capacity holding rows ``rows`` of the first ``columns`` columns."""
        new = _Arena.allocate(self.keys, rows.numel(), self.keys.shape[2])
        torch.index_select(self.keys[:, :, :columns], 0, rows, out=new.keys[:, :, :columns])
        torch.index_select(self.values[:, :, :columns], 0, rows, out=new.values[:, :, :columns])
        new.filled = columns
        return new


def _arena_of(keys: torch.Tensor, values: torch.Tensor) -> _Arena | None:
    """The arena ``keys``/``values`` are the first columns of (only :meth:`_Arena.views` marks
    tensors; any other view or copy, e.g. a subset of rows, has none)."""
    arena = getattr(keys, "_continuum_arena", None)
    return arena if arena is not None and getattr(values, "_continuum_arena", None) is arena else None


@functools.cache
def _append_layer() -> type:
    """The ``DynamicLayer`` subclass that appends into an :class:`_Arena` (built on first use:
    transformers is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class AppendLayer(DynamicLayer):
        """A ``DynamicLayer`` that appends into an :class:`_Arena` instead of concatenating."""

        reserve = 0  # columns the caller expects to append after this forward

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.dtype, self.device = key_states.dtype, key_states.device
                self.keys = self.values = None
                self.is_initialized = True
            L = 0 if self.keys is None else self.keys.shape[2]
            n = key_states.shape[2]
            arena = None if L == 0 else _arena_of(self.keys, self.values)
            if arena is None or not arena.claim(L, n):
                arena = _Arena.allocate(key_states, key_states.shape[0], L + n + max(self.reserve, _MIN_SLACK))
                if L:
                    arena.keys[:, :, :L] = self.keys
                    arena.values[:, :, :L] = self.values
                arena.filled = L + n  # new and not yet shared: no claim needed
            arena.keys[:, :, L:L + n] = key_states
            arena.values[:, :, L:L + n] = value_states
            self.keys, self.values = arena.views(L + n)
            return self.keys, self.values

    return AppendLayer


def length(kv: KV | None) -> int:
    """Number of columns the cache covers."""
    if kv is None:
        return 0
    return kv[0][0].shape[-2] if isinstance(kv, tuple) else kv.width  # (the engine's lazy slab views know theirs)


def select_rows(kv: KV | None, rows: torch.Tensor) -> KV | None:
    """Rows ``rows`` of every layer, as views when the selection allows it.

    A contiguous ascending range is a ``narrow`` view; a single row repeated (forking one state
    into n samples) is an ``expand`` view sharing memory; anything else is an ``index_select`` copy.
    """
    if kv is None:
        return None
    n = rows.numel()
    first = int(rows[0]) if n else 0
    if n and torch.equal(rows, torch.arange(first, first + n, device=rows.device)):
        if first == 0 and n == kv[0][0].shape[0]:
            return kv
        return tuple((k.narrow(0, first, n), v.narrow(0, first, n)) for k, v in kv)
    if n and bool((rows == first).all()):
        return tuple(
            (k.narrow(0, first, 1).expand(n, -1, -1, -1), v.narrow(0, first, 1).expand(n, -1, -1, -1)) for k, v in kv
        )
    out, on = [], _per_device(rows)
    for k, v in kv:
        arena = _arena_of(k, v)
        if arena is not None:  # beam reorder: copy into a new arena, ready to append
            out.append(arena.select_rows(on(k.device), k.shape[2]).views(k.shape[2]))
        else:
            out.append((k.index_select(0, on(k.device)), v.index_select(0, on(k.device))))
    return tuple(out)


def _per_device(index: torch.Tensor):
    """``index`` on a given device, copied once per device: under a ``device_map`` the layers of one
    cache live on several devices, and each layer's index must be where that layer is."""
    copies: dict[torch.device, torch.Tensor] = {index.device: index}

    def on(device: torch.device) -> torch.Tensor:
        if device not in copies:
            copies[device] = index.to(device)
        return copies[device]

    return on


def devices(kv: KV | None) -> tuple[torch.device, ...] | None:
    """The device of each layer (several under a ``device_map`` that spreads layers), or None."""
    return None if kv is None else tuple(k.device for k, _ in kv)


def to_devices(kv: KV | None, where: tuple[torch.device, ...]) -> KV | None:
    """``kv`` with layer ``i`` on ``where[i]`` (layers already there are kept as they are, views included)."""
    if kv is None or devices(kv) == tuple(where):
        return kv
    return tuple((k, v) if k.device == d else (k.to(d), v.to(d)) for (k, v), d in zip(kv, where))


def crop(kv: KV | None, columns: int) -> KV | None:
    """The first ``columns`` columns (a view), or ``None`` for zero columns."""
    if kv is None or columns <= 0:
        return None
    if columns >= kv[0][0].shape[2]:
        return kv
    out = []
    for k, v in kv:
        arena = _arena_of(k, v)
        out.append(arena.views(columns) if arena is not None else (k[:, :, :columns], v[:, :, :columns]))
    return tuple(out)


def _copy_to_arena(k: torch.Tensor, v: torch.Tensor, slack: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``/``v`` copied into a new arena with ``slack`` spare columns (continuing appends in place)."""
    L = k.shape[2]
    small = _Arena.allocate(k, k.shape[0], L + slack)
    small.keys[:, :, :L], small.values[:, :, :L] = k, v
    small.filled = L
    return small.views(L)


def shrink(kv: KV | None) -> KV | None:
    """``kv`` with at most a few hundred spare columns of storage (room a generation reserved and did
    not use, e.g. after an early EOS): one copy when there is more, else ``kv`` itself."""
    if kv is None:
        return None
    out = []
    for k, v in kv:
        arena, L = _arena_of(k, v), k.shape[2]
        if arena is None or arena.keys.shape[2] - L <= 4 * _MIN_SLACK:
            out.append((k, v))
            continue
        out.append(_copy_to_arena(k, v, _MIN_SLACK))
    return tuple(out)


def compact(kv: KV | None) -> KV | None:
    """``kv`` no longer pinning storage it does not use: a layer whose views cover much less than their
    storage (a state cut back to a few tokens, one sample selected out of many) is copied into an
    arena of its exact size (no spare room: a kept slice is often never continued, and continuing
    it would copy anyway, as it does for any view that ends before its arena's fill mark); any
    other layer stays a view.

    Why: a view keeps its whole storage alive, so without this a 5-token slice of a 2000-token state
    (or one of 8 samples) would hold the big state's KV memory for as long as it lives. The copy
    happens only when the storage it frees exceeds the copy itself by more than ``2 * _MIN_SLACK``
    columns, so backing off a few characters stays free and a kept state never pins more than
    about twice its own size.
    ``expand`` views (forked samples sharing one row) are left alone: they share by design.

    Example:
        >>> tiny = compact(crop(kv_of_2000_columns, 5))  # doctest: +SKIP
        >>> nbytes(tiny) * 20 < nbytes(kv_of_2000_columns)  # doctest: +SKIP
        True
    """
    if kv is None:
        return None
    out, changed = [], False
    for k, v in kv:
        used = k.numel() * k.element_size()
        spare = k.untyped_storage().nbytes() - used
        per_column = used // max(k.shape[2], 1)
        if 0 in k.stride() or used == 0 or spare <= used + 2 * _MIN_SLACK * per_column:
            out.append((k, v))
        else:
            out.append(_copy_to_arena(k, v, 0))
            changed = True
    return tuple(out) if changed else kv


def stack_rows(kvs: list[KV], width: int, reserve: int = 0) -> KV:
    """The rows of several caches, one after the other, right-aligned to ``width`` columns, in new storage.

    A cache with fewer columns gets zero-filled leading columns (the caller masks them: zeros, never
    uninitialised memory, because attention weights of 0 times NaN are NaN). The storage leaves room
    for ``reserve`` appended columns, so the next forwards append in place.
    """
    out = []
    for layer in range(len(kvs[0])):
        first = kvs[0][layer][0]
        rows = sum(kv[layer][0].shape[0] for kv in kvs)
        arena = _Arena.allocate(first, rows, width + max(reserve, _MIN_SLACK))
        r = 0
        for kv in kvs:
            k, v = kv[layer]
            n, lead = k.shape[0], width - k.shape[2]
            arena.keys[r:r + n, :, :lead] = 0
            arena.values[r:r + n, :, :lead] = 0
            arena.keys[r:r + n, :, lead:width], arena.values[r:r + n, :, lead:width] = k, v
            r += n
        arena.filled = width
        out.append(arena.views(width))
    return tuple(out)


def assemble(parts: list[list[KV]], width: int, reserve: int = 0) -> KV:
    """One cache of ``len(parts)`` rows in new storage: row ``r`` is the one-row caches ``parts[r]``
    laid side by side (columns in order), right-aligned to ``width`` columns.

    Leading columns a row does not fill are zeros (the caller masks them; never uninitialised memory,
    see :func:`stack_rows`). The storage leaves room for ``reserve`` appended columns. Used by the
    prefix cache to lay cached blocks (and a state's own cached columns) into one batch.
    """
    like = next(p for row in parts for p in row)
    out = []
    for layer, (k0, _) in enumerate(like):
        arena = _Arena.allocate(k0, len(parts), width + max(reserve, _MIN_SLACK))
        for r, row in enumerate(parts):
            end = width - sum(piece[layer][0].shape[2] for piece in row)
            if row:  # one cat per row and layer (a row may be dozens of blocks)
                torch.cat([piece[layer][0][0] for piece in row], 1, out=arena.keys[r, :, end:width])
                torch.cat([piece[layer][1][0] for piece in row], 1, out=arena.values[r, :, end:width])
            arena.keys[r, :, :end] = 0
            arena.values[r, :, :end] = 0
        arena.filled = width
        out.append(arena.views(width))
    return tuple(out)


def gather_columns(kv: KV | None, index: torch.Tensor) -> KV | None:
    """Per-row column gather: ``out[r, :, j] = kv[r, :, index[r, j]]`` (used to realign rows)."""
    if kv is None or index.shape[1] == 0:
        return None
    k0 = kv[0][0]
    on = _per_device(index[:, None, :, None].expand(-1, k0.shape[1], -1, k0.shape[3]))
    return tuple((k.gather(2, on(k.device)), v.gather(2, on(k.device))) for k, v in kv)


def gather_paths(kv: KV | None, rows: torch.Tensor, start: int, split: int, index: torch.Tensor,
                 reserve: int = 0) -> KV | None:
    """New storage holding, for each output row ``j``, the columns ``[start, split)`` of row ``rows[j]``
    followed by its columns ``split + index[j, i]`` (``index``: ``(len(rows), n)``).

    Choice scoring uses it to give a chosen (row, option) pair its own cache: the row's context, then
    the columns of that option's path in the token tree, and nothing of the other options. ``kv`` is
    only read. The storage is an arena with room for ``reserve`` appended columns (at least a few).
    """
    width = split - start + index.shape[1]
    if kv is None or width <= 0:
        return None
    on_rows, on_index = _per_device(rows), _per_device(index)
    out = []
    for k, v in kv:
        r = on_rows(k.device)
        arena = _Arena.allocate(k, rows.numel(), width + max(reserve, _MIN_SLACK))
        for src, dst in ((k, arena.keys), (v, arena.values)):
            if split > start:  # the shared context: one row gather per layer
                torch.index_select(src[:, :, start:split], 0, r, out=dst[:, :, :split - start])
            if index.shape[1]:  # the path columns: only the tree part of each chosen row is copied first
                tree = src[:, :, split:].index_select(0, r)
                at = on_index(k.device)[:, None, :, None].expand(-1, src.shape[1], -1, src.shape[3])
                torch.gather(tree, 2, at, out=dst[:, :, split - start:width])
        arena.filled = width
        out.append(arena.views(width))
    return tuple(out)


def nbytes(kv: KV | None, seen: set | None = None) -> int:
    """Bytes of storage the cache holds, counting storage shared between tensors once."""
    if kv is None:
        return 0
    seen = set() if seen is None else seen
    total = 0
    for pair in kv:
        for t in pair:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total
