"""Counting what a model forward does, with PyTorch forward hooks: positions and time (:class:`ForwardCounter`),
KV-cache bytes (:func:`kv_bytes`, :class:`KVPeak`).

Benchmarks drive continuum through its public API only, plus ONE hook the tests use too: PyTorch forward
hooks on the wrapped Hugging Face module (``model.model.register_forward_pre_hook`` / ``register_forward_hook``,
as ``tests/conftest.py``'s ``count_forward_tokens``): :class:`ForwardCounter` and :class:`KVPeak` are built on it.
"""

from __future__ import annotations

import time


class ForwardCounter:
    """Counts positions passed to the HF model and the wall time spent inside its ``forward``."""

    def __init__(self, hf):
        self.tokens = 0
        self.calls = 0
        self.seconds = 0.0
        self._t0 = 0.0
        hf.register_forward_pre_hook(self._pre, with_kwargs=True)
        hf.register_forward_hook(self._post)

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.tokens += ids.numel()
        self.calls += 1
        self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        self.seconds += time.perf_counter() - self._t0

    def snapshot(self) -> tuple[int, int, float]:
        return self.tokens, self.calls, self.seconds


def _cache_tensors(cache) -> list:
    """The key and value tensors of a transformers ``Cache`` (its ``layers``), or of nothing."""
    return [t for layer in getattr(cache, "layers", None) or () for t in (layer.keys, layer.values) if t is not None]


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of storage behind ``tensors``, each storage counted once (also across calls sharing ``seen``)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def kv_bytes(state, seen: set | None = None) -> int:
    """Bytes of KV storage a state holds (``state.kv_cache``: its tensors, not copies), shared storage once."""
    return storage_bytes(_cache_tensors(state.kv_cache), seen)


class KVPeak:
    """Peak KV bytes of one model forward (its input cache + the cache it returns, shared storage once), read
    with forward hooks on the Hugging Face module while the ``with`` block runs.

    Example:
        >>> with KVPeak(model.model) as peak:      # doctest: +SKIP
        ...     gen(prompts)
        >>> peak.peak                                # bytes
    """

    def __init__(self, hf):
        self.hf, self.peak, self._input, self._handles = hf, 0, [], []

    def _pre(self, module, args, kwargs):
        # the cache object is updated in place by the forward: remember its tensors as they come in
        self._input = _cache_tensors(kwargs.get("past_key_values", kwargs.get("cache")))

    def _post(self, module, args, output):
        seen: set = set()
        held = storage_bytes(self._input, seen) + storage_bytes(_cache_tensors(getattr(output, "past_key_values", None)), seen)
        self.peak, self._input = max(self.peak, held), []

    def __enter__(self) -> KVPeak:
        self._handles = [self.hf.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.hf.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
