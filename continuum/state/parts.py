"""A state saved as a part of a chain: only the columns its base (the state it continues) does not have.

A conversation of K turns saved whole at every turn writes O(K^2) bytes. Saved as parts, turn k writes
only its new columns: the first ``start`` columns are the base's (the same tokens, mask, log-probs
and, with the cache, bit-for-bit the same KV: :func:`shared_columns` checks it), and the part holds
columns ``start:`` with the full state's metadata. Loading a part needs its base loaded first (a chain
is read root first) and gives back exactly the state that was saved. ``kv=False`` saves the tokens
only: the loaded state has no cache and the next generator recomputes it in one pass (cheaper than
reading gigabytes on a GPU). A backend's own KV (llama.cpp's sequences, a :class:`~continuum.models.kv.KVHandle`)
has no columns to cut: its parts are saved as tokens only.
"""

from __future__ import annotations

import torch

from ..errors import StateFileError
from ..models import kv as kvcache
from .convert import uncached
from .core import SequenceState
from .persistence import encode, foreign, last_step, metadata, read, write

__all__ = ["load_part", "part_bytes", "save_part", "shared_columns"]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit where it matters (NaN equals NaN: prompt tokens' log-probs are NaN)."""
    if a.shape != b.shape:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True  # a view of the same storage (the continued state kept the base's cache)
    if torch.equal(a, b):  # (one fused pass; only a NaN, which torch.equal never calls equal, needs the check below)
        return True
    return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else torch.equal(a, b)


_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs of one pattern equal: prompt tokens' log-probs); False also where only the values are
    equal (-0.0 against 0.0, another NaN's bits): the caller then compares values."""
    ints = _INTS.get(a.element_size())
    if ints is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(ints), b.view(ints))


def shared_columns(state: SequenceState, base: SequenceState | None, kv: bool = True) -> int:
    """How many leading columns ``state`` takes unchanged from ``base``: the same ids, mask and
    log-probs, and (``kv``) cached in both with the same KV values; 0 when nothing can be shared."""
    if base is None or base.rows != state.rows or base._ids.device != state._ids.device:
        return 0
    n = min(base._ids.shape[1], state._ids.shape[1])
    mine, theirs = kvcache.tensors(state._kv), kvcache.tensors(base._kv)
    if kv and not (kvcache.opaque(state._kv) or kvcache.opaque(base._kv)):
        if mine is None or theirs is None or len(mine) != len(theirs):
            return 0
        n = min(n, kvcache.length(state._kv), kvcache.length(base._kv))
    lp_a, lp_b = state._logprobs[:, :n], base._logprobs[:, :n]
    if not (torch.equal(state._ids[:, :n], base._ids[:, :n]) and torch.equal(state._mask[:, :n], base._mask[:, :n])
            and _bits_equal(lp_a, lp_b)):  # (a continued state shares all n: three fused checks, not a column scan)
        same = (state._ids[:, :n] == base._ids[:, :n]) & (state._mask[:, :n] == base._mask[:, :n])
        same &= (lp_a == lp_b) | (lp_a.isnan() & lp_b.isnan())
        bad = (~same.all(0)).nonzero()
        n = int(bad[0]) if len(bad) else n
    if kv and n and mine is not None and theirs is not None:
        for (k, v), (bk, bv) in zip(mine, theirs):
            if not (_same(k[..., :n, :], bk[..., :n, :]) and _same(v[..., :n, :], bv[..., :n, :])):
                return 0  # recomputed rather than kept: values may differ in the last bits, so nothing is shared
    return n


def _join(base: torch.Tensor, own: torch.Tensor, start: int) -> torch.Tensor:
    return torch.cat([base[..., :start, :].to(own.device), own], -2)


def _part(state: SequenceState, start: int, kv: bool) -> tuple[dict, dict]:
    tensors = {"ids": state._ids[:, start:], "mask": state._mask[:, start:], "logprobs": state._logprobs[:, start:],
               "weights": state._weights}
    layers = kvcache.tensors(state._kv) if kv else None
    for i, (k, v) in enumerate(layers or ()):
        tensors[f"k{i}"], tensors[f"v{i}"] = k[..., start:, :], v[..., start:, :]
    meta = metadata(state)
    meta["layers"] = len(layers or ())
    meta["part"] = {"start": start, "columns": int(state._ids.shape[1]), "kv": bool(layers)}
    return tensors, meta


def save_part(state: SequenceState, path, start: int = 0, kv: bool = True) -> None:
    """Save columns ``start:`` of ``state`` (``start`` from :func:`shared_columns` against its base),
    with the KV cache when ``kv``; ``start=0`` saves the whole state (a chain's root)."""
    write(path, *_part(state, start, kv))


def part_bytes(state: SequenceState, start: int = 0, kv: bool = True) -> bytes:
    """:func:`save_part`'s file as bytes (a database row holds them); :func:`load_part` reads them back."""
    return encode(*_part(state, start, kv))


def load_part(path, model, base: SequenceState | None) -> SequenceState:
    """The state saved by :func:`save_part` at ``path`` (or :func:`part_bytes`' bytes), its first columns taken
    from ``base`` (the loaded state of the part it continues; None for a root). The result has a cache only when
    every part of the chain was saved with one (by this model)."""
    meta, tensors = read(path, model)
    if isinstance(path, (bytes, bytearray, memoryview)):
        path = "a stored state part"  # (for the messages below)
    part = meta.get("part") or {"start": 0, "kv": meta["layers"] > 0}
    start = int(part["start"])
    try:
        if start and (base is None or base._ids.shape[1] < start or base.rows != tensors["ids"].shape[0]):
            raise StateFileError(f"{path} continues a state of at least {start} columns, which was not given: load its "
                                 f"chain from the root")
        kv = tuple((tensors[f"k{i}"], tensors[f"v{i}"]) for i in range(meta["layers"])) or None
        if kv is not None and foreign(meta, model, path):
            kv = None
        if start:
            assert base is not None
            ids = torch.cat([base._ids[:, :start], tensors["ids"]], 1)
            mask = torch.cat([base._mask[:, :start], tensors["mask"]], 1)
            lps = torch.cat([base._logprobs[:, :start], tensors["logprobs"]], 1)
            theirs = kvcache.tensors(base._kv)
            if kv is not None and theirs is not None and kvcache.length(base._kv) >= start:
                kv = tuple((_join(bk, k, start), _join(bv, v, start)) for (bk, bv), (k, v) in zip(theirs, kv))
            else:
                kv = None
        else:
            ids, mask, lps = tensors["ids"], tensors["mask"], tensors["logprobs"]
        kv = kvcache.from_tensors(model, kv)
        state = SequenceState(model=model, ids=ids, mask=mask, logprobs=lps, weights=tensors["weights"], kv=kv,
                              batch=meta["batch"], samples=meta["samples"], last=last_step(meta["last"]))
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise StateFileError(f"{path} is corrupt ({exc}): save the state again") from exc
    return state if kv is not None else uncached(state, model)
