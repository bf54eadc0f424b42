"""Functional KV-cache operations.

A cache here is a plain tuple ``((keys, values), ...)``, one pair per layer, each tensor of shape
``(rows, heads, columns, head_dim)``. Column ``j`` of the cache holds the keys/values of column
``j`` of the state's token matrix; masked columns (padding, holes) hold values nobody attends to.

Every function returns new tuples and never writes into a tensor it was given, so several
``SequenceState`` objects can share tensors (views) safely. Hugging Face ``Cache`` objects mutate
in place; :func:`to_dynamic_cache` wraps the tensors in a fresh ``DynamicCache`` for one forward
call, whose ``torch.cat`` rebinding leaves the originals intact.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]

__all__ = ["KV", "to_dynamic_cache", "from_dynamic_cache", "select_rows", "crop", "gather_columns", "nbytes", "length"]


_CHECKED_CONFIGS: dict[int, tuple[weakref.ref, int]] = {}  # id(config) -> (config, number of full-attention layers)


def _check_full_attention(config) -> int:
    """Build one ``DynamicCache(config=...)`` per config to check every layer is a full-attention
    ``DynamicLayer`` (sliding-window or linear layers would need another cache layout)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    seen = _CHECKED_CONFIGS.get(id(config))
    if seen is not None and seen[0]() is config:  # ids are reused once a config is freed
        return seen[1]
    layers = DynamicCache(config=config).layers
    bad = {type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer}
    if bad:
        raise NotImplementedError(f"continuum supports full-attention KV caches only, not {sorted(bad)}")
    _CHECKED_CONFIGS[id(config)] = (weakref.ref(config), len(layers))
    return len(layers)


def to_dynamic_cache(kv: Optional[KV], config) -> "DynamicCache":  # noqa: F821
    """A new ``DynamicCache`` whose layers reference ``kv``'s tensors (no copy).

    Built by hand: ``DynamicCache(config=...)`` costs ~0.25 ms, which is on every decoding step.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    n = _check_full_attention(config)
    cache = DynamicCache()
    if kv is None:
        cache.layers = [DynamicLayer() for _ in range(n)]
        return cache
    if len(kv) != n:
        raise ValueError(f"cache has {len(kv)} layers, the model {n}")
    layers = []
    for k, v in kv:
        layer = DynamicLayer()
        layer.dtype, layer.device = k.dtype, k.device
        layer.keys, layer.values = k, v
        layer.is_initialized = True
        layers.append(layer)
    cache.layers = layers
    return cache


def from_dynamic_cache(cache) -> KV:
    return tuple((layer.keys, layer.values) for layer in cache.layers)


def length(kv: Optional[KV]) -> int:
    """Number of columns the cache covers."""
    return 0 if kv is None else kv[0][0].shape[-2]


def select_rows(kv: Optional[KV], rows: torch.Tensor) -> Optional[KV]:
    """Rows ``rows`` of every layer, as views when the selection allows it.

    A contiguous ascending range is a ``narrow`` view; a single row repeated (forking one state
    into n samples) is an ``expand`` view sharing memory; anything else is an ``index_select`` copy.
    """
    if kv is None:
        return None
    rows = rows.to(kv[0][0].device)
    n = rows.numel()
    first = int(rows[0]) if n else 0
    if n and torch.equal(rows, torch.arange(first, first + n, device=rows.device)):
        return tuple((k.narrow(0, first, n), v.narrow(0, first, n)) for k, v in kv)
    if n and bool((rows == first).all()):
        return tuple(
            (k.narrow(0, first, 1).expand(n, -1, -1, -1), v.narrow(0, first, 1).expand(n, -1, -1, -1)) for k, v in kv
        )
    return tuple((k.index_select(0, rows), v.index_select(0, rows)) for k, v in kv)


def crop(kv: Optional[KV], columns: int) -> Optional[KV]:
    """The first ``columns`` columns (a view), or ``None`` for zero columns."""
    if kv is None or columns <= 0:
        return None
    return tuple((k[:, :, :columns], v[:, :, :columns]) for k, v in kv)


def gather_columns(kv: Optional[KV], index: torch.Tensor) -> Optional[KV]:
    """Per-row column gather: ``out[r, :, j] = kv[r, :, index[r, j]]`` (used to realign rows)."""
    if kv is None or index.shape[1] == 0:
        return None
    k0 = kv[0][0]
    idx = index.to(k0.device)[:, None, :, None].expand(-1, k0.shape[1], -1, k0.shape[3])
    return tuple((k.gather(2, idx), v.gather(2, idx)) for k, v in kv)


def nbytes(kv: Optional[KV], seen: Optional[set] = None) -> int:
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
