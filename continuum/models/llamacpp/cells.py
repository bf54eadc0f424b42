"""The pool's cells as the scheduler sees them: how many are in use (shared cells once), what a spill frees, and
making room by spilling only what must go.

llama.cpp does not say how many of its ``n_ctx`` cells are used, and a fork shares its parent's cells (``seq_cp``
sets a bit per cell), so "cells in use" is not the sum of the sequences' lengths. Each sequence therefore records
where its cells came from, as *segments*: ``(origin, lo, hi)``, positions ``lo .. hi-1`` written by the sequence
``origin`` (a key, not the object: a sequence cut back and extended again writes new cells under a new key). A
sequence's own cells are ``(key, own_lo, extent)``; a fork at ``n`` inherits its source's segments clipped at
``n``. Every segment of one origin starts at the same position (that origin's ``own_lo``), so the cells in use are,
per origin, ``max(hi) - lo`` over the resident sequences' segments. A restored sequence (written back from host
bytes into fresh cells) owns all its cells again, unless it shares the prefix it had from the same cells with a
resident relative again (:func:`common_prefix`, :mod:`.reshare`).

Beside where its cells are, each sequence records what they hold, its *content* (:func:`content`): the same
segments, except that cells written back from host bytes keep the origins of the cells the bytes were read from.
Two sequences with a common content prefix hold bit-identical KV there, however often either was spilled and
restored since (the long oracle: a member of a fork family spilled twice, a relative still spilled, shared nothing
when restored, and "no room to restore a spilled state of 125 tokens").

Making room (:func:`make_room`) spills the least recently used idle sequences, a family (sequences sharing cells)
as one unit, and only until the cells asked for are free, instead of every idle sequence: states a program holds
between two calls stay resident while there is room, and a spill that frees no cell (a sequence whose cells live
on in its forks) never happens.

Idle cells are not free to keep: in llama.cpp's unified KV cache every decode's attention runs over the cells up to
the highest one in use, whoever holds them, so states held between calls (a server's stored responses, a program's
old states) slow every later step. On Gemma 3 270M a 40-call chain took 100 ms a call on its own and 150-160 ms
beside 8 finished chains' states (2,600 cells). Before each decode :func:`trim_idle` spills the least recently
used idle families while the idle cells exceed ``max(pool.idle_cells, the running sequences' cells)``, keeping the
most recently used one (a program's or a conversation's next call continues it).

Example:
    >>> used(pool), free(pool)                               # doctest: +SKIP
    (410, 102)
    >>> make_room(pool, 150, pinned=step_seqs)               # doctest: +SKIP
    True
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

from . import seqbytes
from ._lib import lib

SequencePool: TypeAlias = Any  # (sequences.py imports this module: a typing import back would be a circle)
Seq: TypeAlias = Any

__all__ = ["below", "forked", "common_prefix", "content", "restored", "cut", "count", "fresh", "segments", "used", "total",
           "free", "flush", "make_room", "spill_cost", "spill_every_idle", "trim_idle", "IDLE_CELLS"]

# The idle cells a pool keeps resident beside the running ones' (at least): see trim_idle.
IDLE_CELLS = 256

_KEYS = itertools.count(1)


def fresh(seq: Seq) -> None:
    """``seq`` writes its own cells from position 0 (a new sequence, a load)."""
    seq.key, seq.own_lo, seq.inherit = next(_KEYS), 0, ()
    seq.lineage, seq.lin_end = (), 0


def below(segs: Iterable[tuple[int, int, int]], n: int) -> tuple[tuple[int, int, int], ...]:
    """``segs`` clipped to positions below ``n`` (empty runs left out)."""
    return tuple((o, lo, min(hi, n)) for o, lo, hi in segs if lo < min(hi, n))


def _runs(before: tuple, start: int, key: int, end: int) -> list[tuple[int, int, int]]:
    """``before``'s runs below ``end``, then ``key``'s own from ``start`` to ``end``."""
    out = list(below(before, end))
    if end > start:
        out.append((key, start, end))
    return out


def content(seq: Seq) -> list[tuple[int, int, int]]:
    """``(origin, lo, hi)``: what ``seq``'s positions hold, as the origins that computed them (see the module
    docstring): its ``lineage`` below ``lin_end``, its own key from there."""
    return _runs(seq.lineage, seq.lin_end, seq.key, seq.extent)


def restored(seq: Seq) -> None:
    """``seq`` was written back from host bytes into fresh cells: it owns all of them (a new key), and keeps what they
    hold."""
    held = tuple(content(seq))
    seq.key, seq.own_lo, seq.inherit = next(_KEYS), 0, ()
    seq.lineage, seq.lin_end = held, seq.extent


def copied(src: Seq, dst: Seq, n: int) -> None:
    """``dst`` was written from ``src``'s bytes cut at ``n`` (``src`` stays spilled): it owns its cells (a new key) and
    they hold what ``src``'s first ``n`` positions hold."""
    held = below(content(src), n)
    dst.key, dst.own_lo, dst.inherit = next(_KEYS), 0, ()
    dst.lineage, dst.lin_end = held, n


def restore_need(seq: Seq, n: int, cuttable: bool) -> int:  # (cuttable: window.holds(seq, n))
    """Cells making ``n`` positions of spilled ``seq`` available takes: ``n`` when a decode forks them from its bytes
    cut at ``n`` (``window.fork_spilled``: a longer view holds the rest), else all its positions."""
    return n if cuttable and n < seq.longest else seq.extent


def segments(seq: Seq) -> list[tuple[int, int, int]]:
    """``(origin, lo, hi)`` for every run of cells ``seq`` holds (empty runs left out)."""
    return _runs(seq.inherit, seq.own_lo, seq.key, seq.extent)


def forked(src: Seq, dst: Seq, n: int) -> None:
    """After ``seq_cp(src, dst, 0, n)``: ``dst`` shares ``src``'s cells below ``n`` and writes its own from ``n``."""
    dst.inherit, dst.lineage = below(segments(src), n), below(content(src), n)
    dst.key, dst.own_lo, dst.lin_end = next(_KEYS), n, n


def common_prefix(a: Iterable[tuple[int, int, int]], b: Iterable[tuple[int, int, int]]) -> int:
    """Positions ``0 .. n-1`` that two segment lists had from the same cells (the same origins, run by run)."""
    n = 0
    for (oa, la, ha), (ob, lb, hb) in zip(sorted(a, key=lambda x: x[1]), sorted(b, key=lambda x: x[1])):
        if oa != ob or la != n or lb != n:
            break
        n = min(ha, hb)
        if ha != hb:
            break
    return n


def cut(seq: Seq, n: int) -> None:
    """Before ``seq`` is cut back to ``n`` positions (``seq_rm(seq, n, -1)``): cells it writes from ``n`` on are new
    cells, not the ones its forks may still share, so they get a new key."""
    if n >= seq.extent:
        return
    seq.inherit, seq.lineage = below(segments(seq), n), below(content(seq), n)
    seq.key, seq.own_lo, seq.lin_end = next(_KEYS), n, n


def count(seqs: Iterable[Seq], runs: Callable[[Seq], Iterable[tuple[int, int, int]]] | None = None) -> int:
    """Cells ``seqs`` hold together, a shared cell once (per origin: the highest end of its segments less its start).
    ``runs=content``: the cells spilled ``seqs`` take restored together, a common content prefix once (``reshare``)."""
    top: dict[int, tuple[int, int]] = {}
    for s in seqs:
        for o, lo, hi in (runs or segments)(s):
            prev = top.get(o)
            top[o] = (lo, hi if prev is None else max(prev[1], hi))
    return sum(hi - lo for lo, hi in top.values())


def used(pool: SequencePool) -> int:
    """Cells the resident sequences hold (shared cells once), and those kept for the invariant mode (``zombie``)."""
    return count(pool.resident.values()) + pool.zombie_cells


def total(pool: SequencePool) -> int:
    """Cells the states may use: ``n_ctx``, less the one the invariant mode's scratch row takes during a decode."""
    return pool.model.n_ctx - (pool.scratch is not None)


def free(pool: SequencePool) -> int:
    """Cells free now: :func:`total` less those in use (llama.cpp may lose a few to fragmentation: the decode's own
    failure stays the exception path)."""
    return max(0, total(pool) - used(pool))


def spill_cost(seq: Seq) -> int:
    """Cells a spilled sequence takes when it is restored: all of its positions (host bytes go into fresh cells)."""
    return seq.extent


def _families(seqs: list[Seq]) -> list[list[Seq]]:
    """Groups of sequences that share cells (a common origin), each group as one unit."""
    parent = list(range(len(seqs)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[int, int] = {}
    for i, s in enumerate(seqs):
        for o, _, _ in segments(s):
            j = first.setdefault(o, i)
            parent[root(i)] = root(j)
    groups: dict[int, list[Seq]] = {}
    for i, s in enumerate(seqs):
        groups.setdefault(root(i), []).append(s)
    return list(groups.values())


def flush(pool: SequencePool) -> None:
    """The batch-invariant mode's kept cells (``SequencePool.drop``) freed, and the pool packed so that no hole is
    left below a live cell (``seqbytes.repack``): room without taking any sequence out of position order."""
    if pool.zombie is None:
        return
    if pool.zombie_cells:
        lib().llama_memory_seq_rm(pool.model.memory, pool.zombie, -1, -1)
        pool.zombie_cells = 0
    seqbytes.repack(pool.model)
    pool.repacks += 1


def make_room(pool: SequencePool, cells: int, pinned: Iterable[Seq] = (), spare: Iterable[Seq] = ()) -> bool:
    """Spill idle sequences (least recently used family first) until ``cells`` cells are free; False if even every
    idle family spilled would not free them (then nothing is spilled: the caller parks or fails). ``spare``: the
    sequences the operation forked from and no longer needs (their cells it reads live on in its forks), spillable
    though a running call holds them (``SequencePool.idle``). In the batch-invariant mode the kept cells go first, and
    the pool is packed after anything was freed (:func:`flush`). Idle cells past the pool's budget go first
    (:func:`trim_idle`)."""
    trim_idle(pool, pinned)
    have = free(pool)
    if have >= cells:
        return True
    if pool.zombie_cells:
        flush(pool)
        have = free(pool)
        if have >= cells:
            return True
    idle = pool.idle(pinned, spare)
    if not idle:
        return False
    chosen = _plan(pool, _by_age(idle), lambda kept: total(pool) - kept >= cells)
    if chosen is None:
        return False
    _spill(pool, chosen)
    flush(pool)  # (the spills' holes: packed in the invariant mode)
    return True


def trim_idle(pool: SequencePool, pinned: Iterable[Seq] = ()) -> int:
    """Spill the least recently used idle families (not the most recent one) while the idle sequences hold more
    cells than ``max(pool.idle_cells, the cells of the others)``: attention cost stays within about twice what the
    running sequences need (module docstring). Off with ``idle_cells=None`` and in the batch-invariant mode (its pool
    is packed as it is). Returns the sequences spilled."""
    cap = pool.idle_cells
    if cap is None or pool.zombie is not None or pool.scratch is not None or len(pool.resident) < 2:
        return 0
    everyone = list(pool.resident.values())
    held = count(everyone)
    if held <= cap:  # (the cheap check first: every cell counted once)
        return 0
    idle = pool.idle(pinned)
    ids = set(map(id, idle))
    busy = count(s for s in everyone if id(s) not in ids)
    limit = max(cap, busy)
    if held - busy <= limit:
        return 0
    chosen = _plan(pool, _by_age(idle)[:-1], lambda kept: kept - busy <= limit, partial=True)  # (the newest stays)
    return _spill(pool, chosen or [])


def _by_age(seqs: list[Seq]) -> list[list[Seq]]:
    """The families of ``seqs`` (:func:`_families`), least recently used first."""
    return sorted(_families(seqs), key=lambda fam: max(s.last_use for s in fam))


def _plan(pool: SequencePool, families: list[list[Seq]], enough: Callable[[int], bool],
          partial: bool = False) -> list[list[Seq]] | None:
    """The families to spill, in order, until ``enough(cells the resident sequences would still hold)``; a family
    whose cells live on in a kept sequence frees nothing and stays resident. Planned before anything is spilled
    (a spill copies every cell): None when even all of them would not be enough, unless ``partial`` (then what
    frees the most)."""
    resident = list(pool.resident.values())
    gone: set[int] = set()
    chosen: list[list[Seq]] = []
    held = count(resident)
    for fam in families:
        members = set(map(id, fam))
        after = count(s for s in resident if id(s) not in gone and id(s) not in members)
        if after < held:
            chosen.append(fam)
            gone |= members
            held = after
        if enough(held):
            return chosen
    return chosen if partial else None


def _spill(pool: SequencePool, families: list[list[Seq]]) -> int:
    """Spill every resident sequence of ``families``; returns how many."""
    spilled = 0
    for fam in families:
        for s in fam:
            if s.id is not None:
                pool.spill(s)
                spilled += 1
    return spilled


def spill_every_idle(pool: SequencePool, pinned: Iterable[Seq]) -> bool:
    """The exception path, when llama.cpp found no cell although the count said there was room (fragmentation):
    spill every idle sequence outside ``pinned``; False if there was none."""
    idle = pool.idle(pinned)
    for s in idle:
        pool.spill(s)
    kept = pool.zombie_cells
    flush(pool)
    return bool(idle) or bool(kept)
