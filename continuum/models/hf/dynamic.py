"""The bridge between continuum's KV tuples (:mod:`.cache`) and transformers' ``Cache`` objects: which layers a
config has, a fresh ``DynamicCache`` around a KV for one forward (its layers append into :mod:`.cache`'s arenas),
the KV it holds afterwards, and the keyword a model's ``forward`` takes it under."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from .cache import KV, _append_layer

if TYPE_CHECKING:  # for the annotation only: the functions import it where they use it
    from transformers import DynamicCache

__all__ = ["layer_kinds", "to_dynamic_cache", "append_layers", "from_dynamic_cache", "cache_kwargs"]


_CHECKED_CONFIGS: dict[int, tuple[weakref.ref, int, bool]] = {}  # id(config) -> (config, layers, any sliding)


def layer_kinds(config) -> tuple[int, bool]:
    """(number of layers, whether any is a sliding-window layer), from one ``DynamicCache(config=...)``
    per config. Sliding-window layers are served by full ones: every column stays cached (slicing
    back needs them) and the model adapter masks what lies outside the window. Other kinds (linear
    attention) would need another cache layout and are refused; recurrent layers (convolution, SSM state) are
    counted: :mod:`continuum.models.hf.hybrid` serves them."""
    seen = _CHECKED_CONFIGS.get(id(config))
    if seen is not None and seen[0]() is config:  # ids are reused once a config is freed
        return seen[1], seen[2]
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

    layers = DynamicCache(config=config).layers
    # (recurrent layers are hybrid.py's: its HybridKV carries them; spec_of refuses the families it cannot serve)
    bad = {type(layer).__name__ for layer in layers if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)
           and not isinstance(layer, LinearAttentionCacheLayerMixin)}
    if bad:
        raise NotImplementedError(f"continuum supports attention KV caches (full or sliding window), not {sorted(bad)}")
    sliding = any(type(layer) is DynamicSlidingWindowLayer for layer in layers)
    _CHECKED_CONFIGS[id(config)] = (weakref.ref(config), len(layers), sliding)
    return len(layers), sliding


_CACHE_ARGUMENT: dict[Any, str] = {}  # model class -> the keyword its forward takes the Cache under


def _cache_argument(forward_class: Any) -> str:
    if forward_class not in _CACHE_ARGUMENT:
        import inspect

        params = inspect.signature(forward_class.forward).parameters
        _CACHE_ARGUMENT[forward_class] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_ARGUMENT[forward_class]


def cache_kwargs(model, cache) -> dict:
    """The keyword a model's ``forward`` takes its ``Cache`` under: ``cache`` (transformers >= 5.2x, where
    ``past_key_values`` is deprecated, to be removed in 5.40) or ``past_key_values`` (older releases).

    Example:
        >>> model(input_ids=ids, **cache_kwargs(model, to_dynamic_cache(kv, model.config)))   # doctest: +SKIP
    """
    return {_cache_argument(type(model)): cache}


def to_dynamic_cache(kv: KV | None, config, reserve: int = 0) -> DynamicCache:
    """A new ``DynamicCache`` whose layers reference ``kv``'s tensors (no copy).

    ``reserve``: how many more columns the caller expects to append after this forward (decoding
    steps to come); a layer that must allocate leaves that much room. Built by hand:
    ``DynamicCache(config=...)`` costs ~0.25 ms, which is on every decoding step.
    """
    from transformers import DynamicCache

    n, _ = layer_kinds(config)
    cache = DynamicCache()
    cache.layers = append_layers(kv, n, reserve)
    return cache


def append_layers(kv: KV | None, n: int, reserve: int = 0) -> list:
    """``n`` cache layers that append into arenas (see the module docstring), holding ``kv``'s tensors (no copy):
    the layers of :func:`to_dynamic_cache`, and the attention layers of a hybrid model's cache."""
    if kv is not None and len(kv) != n:
        raise ValueError(f"cache has {len(kv)} layers, the model {n}")
    layer_cls = _append_layer()
    layers = []
    for i in range(n):
        layer = layer_cls()
        layer.reserve = reserve
        if kv is not None:
            k, v = kv[i]
            layer.dtype, layer.device = k.dtype, k.device
            layer.keys, layer.values = k, v
            layer.is_initialized = True
        layers.append(layer)
    return layers


def from_dynamic_cache(cache) -> KV:
    return tuple((layer.keys, layer.values) for layer in cache.layers)
