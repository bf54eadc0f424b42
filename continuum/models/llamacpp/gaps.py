"""Cells of a sliding-window cache that llama.cpp gave to other tokens behind a sequence's end, found by a probe.

llama.cpp's ``find_slot`` counts a sliding-window cell as free once it lies outside the window behind its one
sequence's END (masked for that sequence), and hands it to new tokens; a view behind that end (a cut, a rollback, a
fork's parent, a prefix-cache donor, a relative a restored sequence shares) still reads it, and nothing says so:
``seq_pos_min`` sees the lowest cell only. The oracle found it on a tiny Gemma 3 with a window of 8 (log-probs off by
up to 26 nats, continued over the gaps). :mod:`.window` probes before such a view is extended or forked and before a
sequence is cut back to a view; :mod:`.reshare` before a relative's cells are shared. Both ask :func:`held`.

Example:
    >>> intact(pool, seq_id, 13, 20, 44)   # positions 13..19 still in sequence seq_id's cells?   # doctest: +SKIP
    True
    >>> held(pool, seq_id, 13, 20)   # ... and a decode at 20 may read them (not broken, none missing)  # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import Any

from ._lib import lib

__all__ = ["held", "intact"]


def intact(pool: Any, seq_id: int, lo: int, hi: int, end: int) -> bool:
    """Whether sequence ``seq_id`` (``end`` positions) still holds its cells at positions ``[lo, hi)`` (at most
    ``n_swa - 1`` of them, behind its end; False for a range past its end). Probe: those cells, then as many behind
    the end (never given away: inside the window), copied into the pool's probe id in turn; their bytes
    (``llama_state_seq_get_size``: every cell of both caches) are as long only if none is missing. True without a
    probe id (no sliding window). A sequence cut back over gaps has holes behind its end too, which this cannot see:
    callers check ``Seq.broken`` first (``window.check_cut``). Under the model's lock."""
    m = hi - lo
    if m <= 0:
        return True
    if hi > end:  # (it does not reach hi: a relative shorter than the prefix a restored member would share)
        return False
    if hi == end or pool.probe is None:  # (the window behind its own end: find_slot never gives those cells away)
        return True
    L, mem, ctx, probe = lib(), pool.model.memory, pool.model.ctx, pool.probe
    sizes = []
    for start in (lo, end - m):
        L.llama_memory_seq_cp(mem, seq_id, probe, start, start + m)
        sizes.append(int(L.llama_state_seq_get_size(ctx, probe)))
        L.llama_memory_seq_rm(mem, probe, -1, -1)
    return sizes[0] == sizes[1]


def held(pool: Any, seq_id: int, lo: int, hi: int) -> bool:
    """Whether resident sequence ``seq_id`` holds every cell at positions ``[lo, hi)`` for a decode to read: not cut
    back over gaps (``Seq.broken``: holes no probe sees, ``window.check_cut``), its lowest cell at or below ``lo``,
    reaching ``hi``, and none given away behind its end (:func:`intact`). The one question ``window.fits`` (a decode
    at ``hi``) and ``reshare`` (a relative's window shared with a restored member) ask; a twin of it let a broken
    relative's window through once. Under the model's lock."""
    if hi <= lo:
        return True
    if getattr(pool.resident.get(seq_id), "broken", False):
        return False
    L, mem = lib(), pool.model.memory
    first, last = int(L.llama_memory_seq_pos_min(mem, seq_id)), int(L.llama_memory_seq_pos_max(mem, seq_id))
    return 0 <= first <= lo and intact(pool, seq_id, lo, hi, last + 1)
