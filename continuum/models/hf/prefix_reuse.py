"""The decoding loop's side of the transformers prefix cache (:mod:`.prefix_cache` is the table): a state's rows
extended by their longest cached prefixes before the prefill (:func:`reuse`), what a prefill computed added
(:func:`remember`), and the calls waiting for another's prefill of their prefix woken (:func:`settle`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from ...loop.arrivals import GATE
from ..kv import length as kv_length
from . import cache as kvcache
from .tensorkv import TensorKV

if TYPE_CHECKING:
    from ...state import SequenceState

PrefixCache: TypeAlias = Any  # (.prefix_cache's table, which imports this module: a typing import back would be a circle)
_Block: TypeAlias = Any

__all__ = ["reuse", "remember", "settle"]


_WAIT_S = 120.0  # the longest a call waits for another's prefill of its prefix before computing it itself


def _timing_dependent(model) -> bool:
    """Under torchrun a named concurrent call (``continuum.loop.ranks.call_key``) neither reads nor fills the
    prefix cache: whether another call's blocks are there yet depends on each rank's timing, and ranks must
    run forwards of the same shapes."""
    from ...loop.ranks import current_key

    return current_key() is not None and model.scheduler.coordinated


def _identity(model) -> tuple:
    return (getattr(model, "fingerprint", id(model)), str(model.model.dtype), str(model.device))


def reuse(state: SequenceState, room: int = 0) -> SequenceState:
    """``state`` with each row's cache extended by the longest cached prefix of its tokens (rows may differ).

    A row's last token is never taken from the cache (its logits are needed). Rows with a hit get
    the cached blocks as their cached columns; the other rows keep their own cache. The new state
    has the same tokens, log-probs, weights and last step; its KV is new storage (with ``room``
    spare columns for the tokens the caller will append). ``state`` itself when nothing is reused.
    """
    cache = getattr(state._model, "prefix_cache", None)
    if cache is None or _timing_dependent(state._model):
        return state
    B, C = cache.block_size, kv_length(state._kv)
    real, own = state._real_rows(), state._cached_real()
    todo = [r for r in range(state.rows) if (len(real[r][0]) - 1) // B * B > own[r]]
    if not todo:
        return state
    identity = _identity(state._model)
    for _ in range(8):  # in-batch sharing: wait for a concurrent call computing a longer prefix, then look again
        hits: dict[int, list[_Block]] = {}
        wait = None
        for r in todo:
            chain = cache.acquire(identity, real[r][0][:-1], own[r])
            if chain:
                hits[r] = chain
            if state._model.scheduler.coordinated:  # torchrun: a wait would depend on this rank's timing
                continue
            wait = cache.computing(real[r][0][:-1], max(len(chain) * B, own[r]))
            if wait is not None:
                break
        if wait is None:
            break
        for chain in hits.values():
            cache.release(chain)
        cache.settle()  # a waiting call holds no prefix others could wait for (no cycle)
        state._model.engine.arrivals.arrived()  # (nor does the engine's next step wait for its setup)
        with GATE.waiting():
            wait.done.wait(_WAIT_S)  # (not yet submitted to the engine: nobody waits for this call meanwhile)
    else:
        hits = {}
    if not hits:
        return state
    try:
        if state._kv is not None and state._kv.dtype() != next(iter(hits.values()))[0].kv[0][0].dtype:
            return state  # a cache of another dtype (to_model recomputes such states)
        return _relayout(state, hits, B, C, room)
    finally:
        for chain in hits.values():
            cache.release(chain)


def _first_real(mask: torch.Tensor, start: int, end: int) -> list[int]:
    """Per row, the first column in ``[start, end)`` holding a real token (``end`` when none)."""
    region = mask[:, start:end].bool()
    if end <= start:
        return [end] * mask.shape[0]
    return [start + int(i) if ok else end for i, ok in zip(region.int().argmax(1).tolist(), region.any(1).tolist())]


def _relayout(state: SequenceState, hits: dict[int, list[_Block]], B: int, C: int, room: int) -> SequenceState:
    """The state with hit rows laid out as [cached blocks | rest of the row], every other row as
    [its own cached columns | its uncached columns] (leading padding dropped); both parts
    right-aligned at a common column, so one forward computes every row's uncached part."""
    R, W = state._ids.shape
    real = state._real_rows()
    lead, start = _first_real(state._mask, 0, C), _first_real(state._mask, C, W)  # own rows: where content begins
    cached = [len(hits[r]) * B if r in hits else C - lead[r] for r in range(R)]
    tails = [len(real[r][0]) - cached[r] if r in hits else W - start[r] for r in range(R)]
    width = max(cached)
    total = width + max(tails)
    dev, pad = state._ids.device, state._model.tokenizer.pad_token_id
    ids = torch.full((R, total), pad, dtype=state._ids.dtype, device=dev)
    mask = torch.zeros((R, total), dtype=state._mask.dtype, device=dev)
    lp = torch.full((R, total), float("nan"), dtype=state._logprobs.dtype, device=dev)
    parts: list[list[kvcache.KV]] = []
    for r in range(R):
        h, t = cached[r], tails[r]
        if r in hits:
            toks, lps = real[r]
            ids[r, width - h:width], ids[r, total - t:] = torch.tensor(toks[:h]), torch.tensor(toks[h:])
            mask[r, width - h:width] = mask[r, total - t:] = 1
            lp[r, width - h:width] = torch.tensor(lps[:h], dtype=lp.dtype)
            lp[r, total - t:] = torch.tensor(lps[h:], dtype=lp.dtype)
            parts.append([tuple((k[None], v[None]) for k, v in block.kv) for block in hits[r]])
            continue
        for dst, src in ((ids, state._ids), (mask, state._mask), (lp, state._logprobs)):
            dst[r, width - h:width] = src[r, lead[r]:C]
            dst[r, total - t:] = src[r, start[r]:]
        if not h:
            parts.append([])
            continue
        assert state._kv is not None, "a row with cached columns (h > 0) means the state holds a KV cache"
        parts.append([tuple((k[r:r + 1, :, lead[r]:C], v[r:r + 1, :, lead[r]:C]) for k, v in state._kv.tensors())])
    kv = TensorKV(kvcache.assemble(parts, width, (total - width) + min(room, kvcache.RESERVE_CAP)))
    from ...state import SequenceState

    return SequenceState(model=state._model, ids=ids, mask=mask, logprobs=lp, weights=state._weights, kv=kv,
                         batch=state.batch, samples=state.samples, last=state._last)


@torch.inference_mode()  # (blocks are written in place: always under inference mode, whoever calls)
def remember(model, ids: torch.Tensor, mask: torch.Tensor, kv: kvcache.KV, owner: int | None = None) -> None:
    """Add the full blocks of every row that a prefill just computed (``kv`` covers the first
    ``length(kv)`` columns of ``ids``/``mask``); calls waiting for these prefixes find them now
    (those registered by thread ``owner``, default this one)."""
    cache = getattr(model, "prefix_cache", None)
    if cache is None or _timing_dependent(model):
        return
    try:
        if kv is not None and cache.block_bytes(kv) <= cache.max_bytes:  # else not even one block fits
            _insert_rows(cache, _identity(model), ids, mask, kv)
    finally:
        cache.settle(owner)


def _insert_rows(cache: PrefixCache, identity: tuple, ids: torch.Tensor, mask: torch.Tensor, kv: kvcache.KV) -> None:
    L = kvcache.length(kv)
    seen: set[tuple] = set()
    for r in range(ids.shape[0]):
        columns = mask[r, :L].nonzero().flatten()
        tokens = ids[r, columns].tolist()
        key = tuple(tokens[:len(tokens) // cache.block_size * cache.block_size])
        if key and key not in seen:  # rows repeated (samples of one prompt) are inserted once
            seen.add(key)
            cache.insert(identity, tokens, kv, r, columns)


def settle(model) -> None:
    """The calling thread's loop ends: prefixes it registered as being computed are abandoned (if not yet inserted)."""
    cache = getattr(model, "prefix_cache", None)
    if cache is not None:
        cache.settle()
