"""Hybrid models on llama.cpp (attention + recurrent layers, e.g. LFM2): each sequence's recurrent summary, and the
snapshots that let a state be continued from a position its sequence has moved past.

A llama.cpp sequence of a hybrid model holds attention cells (one per position, shareable, cut back with
``seq_rm``) and ONE recurrent summary, the state after its last position (llama.cpp refuses to cut it back:
"partial removal" of a recurrent memory fails). A view ``(sequence, n)`` of :mod:`.sequences` is therefore usable
for decoding only where the summary can be had at ``n``: the sequence ends there (``extent == n``), or a
**snapshot** was kept at ``n`` (``Seq.snaps[n]``: the recurrent part alone, ``llama_state_seq_get_data_ext`` with
``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``, a few KB to a few MB per row).

Policy (bounded, documented in docs/hybrid.md):

* A snapshot is taken at the end of every call, for each row (``SeqKV.settle``, once per position): the state a
  call returns can be continued twice, or after its sequence moved on. Positions inside a call keep none. A call
  that starts from a sequence's end without one (a loaded state) takes it at its setup (:func:`stale`), or before the
  decode that restores a spilled one and extends it in place (``decode._plan``).
  (A spilled sequence's bytes hold its summary at its end.)
* A fork at ``n`` copies the attention cells (``seq_cp``: shared) and restores the snapshot at ``n`` into the new
  sequence; rewinding a sequence to ``n`` restores it then cuts the attention tail.
* A slice of a state (``state[..., :k]``) is cut back to the nearest position ``<= k`` whose summary can be had
  (:func:`usable`); the state recomputes the tokens after it. Exact, never approximated.
* Snapshots are kept per sequence (forks inherit those at or before their start) and go with the sequence.

Example:
    >>> kv = gen("Once upon a time", max_tokens=8)._kv          # a SeqKV on an LFM2 GGUF   # doctest: +SKIP
    >>> kv.views[0].seq.snaps                                   # none yet: the sequence ends there   # doctest: +SKIP
    {}
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any, TypeAlias

from ...errors import BackendError
from . import cells
from ._lib import lib

# (the pool, its sequences and views are sequences.py's SequencePool, seq.py's Seq and KVView, typed Any here:
SequencePool: TypeAlias = Any  # sequences.py imports this module, and a typing import back would be a circle)
Seq: TypeAlias = Any
KVView: TypeAlias = Any

__all__ = ["snapshot", "keep_end", "keep_ends", "stale", "forked", "usable", "restore_at", "rewind", "undo"]

PARTIAL_ONLY = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (alias SWA_ONLY): the recurrent part of a hybrid's memory


def snapshot(pool: SequencePool, seq_id: int) -> bytes:
    """The recurrent part of sequence ``seq_id`` as llama.cpp writes it (the summary after its last position)."""
    L, ctx = lib(), pool.model.ctx
    size = int(L.llama_state_seq_get_size_ext(ctx, seq_id, PARTIAL_ONLY))
    buf = (ctypes.c_uint8 * size)()
    if int(L.llama_state_seq_get_data_ext(ctx, buf, size, seq_id, PARTIAL_ONLY)) != size:
        raise BackendError(f"llama.cpp wrote a recurrent snapshot of sequence {seq_id} short of its {size} bytes")
    pool.snapshots += 1
    return bytes(buf)


MAX_SNAPSHOTS = 32  # per sequence, as transformers' HybridKV keeps (a long chat of many calls must not grow unbounded)


def keep_end(pool: SequencePool, seq: Seq) -> None:
    """Snapshot ``seq`` at its end unless one is kept there (before it is extended or cut in place); at most
    ``MAX_SNAPSHOTS`` are kept, the oldest dropped first, except where a live view ends (a state the user holds
    must stay continuable without a recompute)."""
    if seq.extent and seq.extent not in seq.snaps:
        assert seq.id is not None
        seq.snaps[seq.extent] = snapshot(pool, seq.id)
        if len(seq.snaps) > MAX_SNAPSHOTS:
            held = set(seq.holders)
            for p in sorted(seq.snaps):
                if len(seq.snaps) <= MAX_SNAPSHOTS:
                    break
                if p not in held:  # (a view ending at p still needs it; a dropped one is recomputed: usable())
                    del seq.snaps[p]


def keep_ends(pool: SequencePool, views: Iterable[KVView]) -> None:
    """Snapshot the summary of each view's sequence that ends where the view does (a call's result: ``settle``)."""
    with pool.model.lock:
        pool.collect()
        for v in views:
            seq = v.seq
            if seq is not None and seq.id is not None and v.n_tokens == seq.extent:
                keep_end(pool, seq)


def stale(pool: SequencePool, views: Iterable[KVView]) -> list[int]:
    """At a call's setup: each resident view's sequence snapshotted where the view ends at the sequence's end and no
    snapshot is kept there (a loaded state's, a restored one's), so that the call may extend the sequence in place
    and the state it started from stays continuable; returns the indices of the views whose summary cannot be had
    (none by this policy: the caller would recompute those rows, never fail)."""
    out = []
    with pool.model.lock:
        pool.collect()
        for i, v in enumerate(views):
            seq, n = v.seq, v.n_tokens
            if seq is None or n == 0:
                continue
            if n == seq.extent:
                if seq.id is not None:
                    keep_end(pool, seq)
            elif n not in seq.snaps:
                out.append(i)
    return out


def forked(pool: SequencePool, src: Seq, dst: Seq, n: int) -> None:
    """After ``seq_cp(src, dst, 0, n)``: ``dst``'s summary put at ``n`` and the snapshots before it shared (one is
    taken at ``n`` when ``src`` ends there: a fork's rows, samples or options, can then be cut back to it)."""
    if n == src.extent:
        keep_end(pool, src)
    restore_at(pool, src, dst.id, n)
    dst.snaps = {p: b for p, b in src.snaps.items() if p <= n}


def usable(seq: Seq | None, n: int) -> int:
    """The longest prefix ``<= n`` of ``seq`` whose recurrent summary can be had: ``n`` at the sequence's end or at
    a snapshot, else the nearest snapshot before it (0: none, recompute from the start)."""
    if seq is None or n == 0 or n == seq.extent or n in seq.snaps:
        return n
    return max((p for p in seq.snaps if p <= n), default=0)


def restore_at(pool: SequencePool, src: Seq, dst_id: int, n: int) -> None:
    """Put ``src``'s recurrent summary at ``n`` into sequence ``dst_id`` (a fork's, after ``seq_cp`` copied the
    attention cells and ``src``'s latest summary): nothing to do when ``src`` ends at ``n``."""
    if n == src.extent:
        return
    blob = src.snaps.get(n)
    if blob is None:  # (the views are cut to usable positions: reaching here is a bug, never a wrong result)
        raise BackendError(f"no recurrent snapshot at position {n} of this hybrid model's sequence (it ends at "
                           f"{src.extent}; snapshots at {sorted(src.snaps)}): recompute the state from its tokens")
    if not _set(pool, dst_id, blob):
        raise BackendError("llama.cpp refused a recurrent snapshot of this model's own sequence: recompute the state "
                           "from its tokens")


def _set(pool: SequencePool, seq_id: int, blob: bytes) -> bool:
    buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    ok = int(lib().llama_state_seq_set_data_ext(pool.model.ctx, buf, len(blob), seq_id, PARTIAL_ONLY)) != 0
    pool.restores_recurrent += ok
    return ok


def rewind(pool: SequencePool, seq: Seq, n: int) -> None:
    """Cut ``seq`` back to its first ``n`` positions: the snapshot at ``n`` restored (llama.cpp cannot cut a
    recurrent summary), then the attention cells past ``n`` removed."""
    assert seq.id is not None
    restore_at(pool, seq, seq.id, n)
    if not lib().llama_memory_seq_rm(pool.model.memory, seq.id, n, -1):
        raise BackendError(f"llama.cpp refused to cut a hybrid sequence back to {n} positions")
    cells.cut(seq, n)
    seq.extent = n
    for p in [p for p in seq.snaps if p > n]:
        del seq.snaps[p]


def undo(pool: SequencePool, seq: Seq, n: int) -> None:
    """After a failed decode that llama.cpp did not undo (an abort mid-batch): ``seq`` back to ``n`` positions from
    its snapshot there; without one its cells are all removed, so a view on it fails loudly (positions no longer
    continue) instead of decoding against a summary that moved on."""
    assert seq.id is not None
    L, mem = lib(), pool.model.memory
    blob = seq.snaps.get(n)
    if blob is not None and _set(pool, seq.id, blob) and L.llama_memory_seq_rm(mem, seq.id, n, -1):
        return
    L.llama_memory_seq_rm(mem, seq.id, -1, -1)
    seq.extent, seq.snaps = 0, {}
