"""Moving a state to a model: ``state.to_model(model)``.

A KV cache is valid only under the weights, dtype and device that computed it. The rule: the model that runs is
the one that computes. A state handed to another model keeps its tokens, weights, log-probs and last step and drops
its cache, so that model recomputes every token (in one forward pass, when the state is continued). That model may
be another backend's (a transformers state continued on llama.cpp and back) when its ids mean the same thing there
(:func:`same_tokenizer`). The same model keeps the cache (a backend whose KV lives in an instance's own storage,
llama.cpp's cells, keeps it only on an instance that ``holds`` it: another instance of the same file recomputes);
if the model's dtype changed since the cache was computed (``model.model.double()``) the cache is dropped too
(recomputing gives exactly what the model computes now), and if only the device changed the cache is moved (the
values are the same).
"""

from __future__ import annotations

import logging

from ..errors import ModelMismatch, TokenizerMismatch
from ..models import kv as kvcache
from .core import SequenceState

__all__ = ["to_model", "check_same_model"]

logger = logging.getLogger("continuum")


def same_tokenizer(a, b) -> bool:
    """Whether ``a``'s token ids mean the same on ``b``: the same tokenizer, or the same id -> token map on another
    backend (``ids_fingerprint``, :mod:`continuum.models.idmap`: e.g. one vocabulary as safetensors and as GGUF)."""
    ta, tb = a.tokenizer, b.tokenizer
    if ta is tb or ta.fingerprint == tb.fingerprint:
        return True
    ia, ib = getattr(ta, "ids_fingerprint", None), getattr(tb, "ids_fingerprint", None)
    return ia is not None and ia == ib


def check_tokenizer(state: SequenceState, model, what: str) -> None:
    if not same_tokenizer(state._model, model):
        raise TokenizerMismatch(
            f"{what}: the state's tokenizer ({state._model.tokenizer.name!r}, {state._model.tokenizer.fingerprint}) "
            f"differs from {model.tokenizer.name!r} ({model.tokenizer.fingerprint}), so its token ids mean nothing "
            f"there. Rebuild it from its text: SequenceState.from_prompts(model, list(state)) (weights and "
            f"log-probs are not carried).")


def check_same_model(state: SequenceState, other: SequenceState, op: str) -> None:
    """Raise :class:`TokenizerMismatch` / :class:`ModelMismatch` unless ``other`` belongs to ``state``'s model."""
    check_tokenizer(other, state._model, f"cannot {op} states of different tokenizers")
    if not state._model.same_model(other._model):
        raise ModelMismatch(
            f"cannot {op} states of different models ({state._model!r} and {other._model!r}): a KV cache is only "
            f"valid for the model that computed it. Convert one first: other.to_model(state.model) keeps its "
            f"tokens, weights and log-probs and drops its cache (recomputed in one pass when continued).")


def to_model(state: SequenceState, model) -> SequenceState:
    """``state`` for ``model`` (see the module docstring); ``state`` itself when nothing changes."""
    if not hasattr(model, "tokenizer") or not hasattr(model, "same_model"):
        raise TypeError(f"to_model takes a continuum model (models.Transformers), got {type(model).__name__}")
    if state._model is model and _unchanged(state, model):  # (every call's input: nothing to compare or move)
        return state
    check_tokenizer(state, model, "cannot move this state to another model")
    if not state._model.same_model(model):
        return uncached(state, model)
    kv, dev = state._kv, model.device
    holds = getattr(model, "holds", None)
    if kvcache.opaque(kv) and model is not state._model and holds is not None and not holds(kv):
        return uncached(state, model)  # the same weights in another instance: its cells live in the other's pool
    if kvcache.dtype(kv) is not None and kvcache.dtype(kv) != model.kv_dtype:
        logger.warning("This state's KV cache is %s but the model now computes %s (its dtype changed after the "
                       "state was made): the cache is dropped and recomputed.", kvcache.dtype(kv), model.kv_dtype)
        return uncached(state, model)
    where = model.layer_devices if kv is not None else None
    moved = state._ids.device != dev or (kv is not None and kvcache.devices(kv) != where)
    if model is state._model and not moved:
        return state
    if moved and where is not None:  # same values, other device(s): each layer to its layer's device (device_map)
        kv = kvcache.to_devices(kv, where)  # (where is None only without a cache: nothing to move)
    return SequenceState(model=model, ids=state._ids.to(dev), mask=state._mask.to(dev), logprobs=state._logprobs.to(dev),
                         weights=state._weights, kv=kv, batch=state.batch, samples=state.samples, last=state._last)


def _where(model) -> tuple:
    """Where ``model`` computes now: its device, its KV dtype, its layers' devices."""
    return model.device, model.kv_dtype, model.layer_devices


def _unchanged(state: SequenceState, model, where: tuple | None = None) -> bool:
    """Whether ``state`` (of ``model``) is where ``model`` computes now (``where``: :func:`_where`, read once by a
    caller checking many states): its ids on the model's device, its cache (if any) of the model's KV dtype on its
    layers' devices. A backend's opaque handle is checked the long way."""
    return unchanged_at(state._ids.device, state._kv, model, where)


def unchanged_at(device, kv, model, where: tuple | None = None) -> bool:
    """:func:`_unchanged` of a state whose ids are on ``device`` and whose cache is ``kv`` (a state not built yet:
    ``deferred.Part``)."""
    if kv is None:
        return device == model.device
    if kvcache.opaque(kv):
        return False
    dev, kv_dtype, layers = where or _where(model)
    return device == dev and kvcache.dtype(kv) == kv_dtype and kvcache.devices(kv) == layers


def to_model_all(states: list[SequenceState], model) -> list[SequenceState]:
    """:func:`to_model` of each state (a stack's), ``model``'s device, KV dtype and layer devices read once for all
    (128 callers' states of a joint call stacked again: B22b)."""
    where: tuple | None = None
    out = []
    for s in states:
        if s._model is model and s._kv is not None and not kvcache.opaque(s._kv):
            where = where or _where(model)
            if _unchanged(s, model, where):
                out.append(s)
                continue
        out.append(to_model(s, model))
    return out


def uncached(state: SequenceState, model) -> SequenceState:
    """The same tokens, weights, log-probs and last step on ``model``, with no cache."""
    if kvcache.length(state._kv) == 0 and state._model is model:
        return state
    real = state._real_rows()
    return SequenceState._from_rows(model, [ids for ids, _ in real], [lps for _, lps in real], state._weights,
                                    state.batch, state.samples, state._last)
