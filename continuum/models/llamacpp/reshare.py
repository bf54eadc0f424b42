"""A restored fork family shares its prefix again (issue 56: "nothing refused that fits").

A fork family (samples or beams of one state) shares its prefix's cells while resident (``seq_cp``: a bit per cell).
Spilled, each member is written as its own bytes, the shared prefix in each (llama.cpp's per-sequence state API has
no other form), so restored apart the family took n times the prefix's cells: one that fitted resident was refused
("no room to restore a spilled state", found by the long oracle on a 256-cell pool). :func:`reshare` runs after each
restore: the prefix the restored sequence holds in common with a resident relative (the same content: the cells'
origins, through any number of spills and restores, ``cells.content``) is bit for bit the same, so its copy is
dropped and the relative's shared. The relative is any resident sequence: one restored before it, or one that was
never spilled (a running call held it while the idle members went).

Where the relative is resident before the restore, :func:`restore` does better: it writes only the member's own
cells, from the common prefix on (``seqbytes.tail``: llama.cpp's bytes after ``seq_rm(seq, 0, n)``), then shares the
prefix (``seq_cp``; in that order, since writing bytes empties the sequence first). Writing the whole member and
dropping its prefix after took the prefix's cells twice for a moment: a 4-member family of a 107-token state, one
member held by a running call beside another call, was refused its restore with ~98 cells free where 4 were needed
(the long oracle, batch-invariant mode on 256 cells).

* The batch-invariant mode: the dropped copy is kept by the zombie id like every drop (no hole opens below a live
  cell), and the sequence's cells stay in position order (the relative's bytes were written before its own, below;
  :func:`restore` writes the member's own cells above every live one, as any write in this mode).
* Sliding windows (Gemma 3): ``seq_rm``/``seq_cp`` act on both of llama.cpp's caches; the base cache holds every
  position, the window cache only the window behind each restored end. The relative's window cells replace the
  sequence's own below the cut, so the relative must hold the window the sequence's next decode reads
  (``pos_min`` at most ``extent - n_swa + 1`` where the cut reaches into that window): otherwise only the positions
  below that window are shared (the sequence's own cells from there on hold its window).
* Hybrids (recurrent state): not reshared (``seq_cp`` copies the latest recurrent summary, which would replace the
  restored sequence's own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import cells, gaps, seqbytes
from ._lib import lib

__all__ = ["reshare", "restore", "settle", "adopt", "MIN_CELLS"]

# Any common prefix is shared: the pool's pricing of a spilled family (``capacity.rows_cells``: a common content
# prefix once) assumes it. At 16 (two llama calls were thought not worth fewer cells) six samples of two prompts on
# the 256-cell pool, 12-13 common positions each, were priced at 216 cells and restored apart in 264: refused
# mid-call (stress driver, window-8 GGUF, seed 7, history 1).
MIN_CELLS = 1


def restore(pool: Any, seq_id: int, blob: bytes, held: Sequence, extent: int, pinned: list) -> tuple[Any, int]:
    """Write ``blob`` (a spilled sequence's bytes: ``extent`` positions holding ``held``, ``cells.content``) into the
    free id ``seq_id``; where a resident relative holds a common prefix of ``n`` positions, only the cells from ``n``
    on are written and the prefix is shared (the module docstring). Returns ``(relative, n)`` for :func:`settle`, once
    the caller has recorded the restore (``cells.restored``/``copied``), or ``(None, 0)`` (the whole bytes written:
    :func:`reshare` after). Raises ``pool.write``'s refusal; the id's cells are then empty. Under the model's lock."""
    best, n = _relative(pool, held, extent)
    part = seqbytes.tail(blob, n) if best is not None else None
    if part is None or not cells.make_room(pool, extent - n, [best, *pinned]):
        pool.write(seq_id, blob, extent, pinned)  # (the relative may have to go to make room: then it is not shared)
        return None, 0
    pool.write(seq_id, part, extent - n, [best, *pinned])
    lib().llama_memory_seq_cp(pool.model.memory, best.id, seq_id, 0, n)
    return best, n


def reshare(pool: Any, seq: Any) -> bool:
    """After resident ``seq`` (a ``Seq`` of ``pool``) was restored from bytes (``cells.restored``), share the longest
    prefix it holds in common with a resident relative (``cells.content``). Under the model's lock. Returns True if
    it did."""
    best, n = _relative(pool, cells.content(seq), seq.extent, seq)
    if best is None:
        return False
    pool.drop(seq.id, 0, n)
    if pool.zombie is not None:
        pool.zombie_cells += n
    lib().llama_memory_seq_cp(pool.model.memory, best.id, seq.id, 0, n)
    adopt(pool, seq, best, n)
    return True


def settle(pool: Any, seq: Any, relative: Any, n: int) -> None:
    """After a restore recorded (``cells.restored``/``copied``): :func:`adopt` what :func:`restore` shared, or
    :func:`reshare` where it wrote the whole bytes."""
    if relative is not None:
        adopt(pool, seq, relative, n)
    else:
        reshare(pool, seq)


def adopt(pool: Any, seq: Any, relative: Any, n: int) -> None:
    """Record that restored ``seq`` shares ``relative``'s cells below ``n`` (what it holds is unchanged: only where)."""
    held = cells.content(seq)
    cells.forked(relative, seq, n)
    seq.lineage, seq.lin_end = tuple(held), seq.extent
    pool.reshared += 1


def _relative(pool: Any, held: Sequence, extent: int, seq: Any = None) -> tuple[Any, int]:
    """The resident sequence (other than ``seq``) holding the longest prefix in common with content ``held`` of
    ``extent`` positions, and its length; ``(None, 0)`` below :data:`MIN_CELLS` and on hybrids (``seq_cp`` copies the
    latest recurrent summary, which would replace the restored sequence's own)."""
    if pool.model.hybrid:
        return None, 0
    best, n = None, 0
    for other in pool.resident.values():
        if other is seq:
            continue
        m = cells.common_prefix(held, cells.content(other))
        if m > n and not _window_kept(pool, other, extent, m):
            m = min(m, _below_window(pool, extent))  # (what lies below the window: its own cells are written above)
        if m > n:
            best, n = other, m
    return (best, n) if best is not None and n >= MIN_CELLS else (None, 0)


def _below_window(pool: Any, extent: int) -> int:
    """Positions of a sequence of ``extent`` that its next decodes never read through a sliding window: below
    them only the full-attention layers read, whose cells a relative holds for every position (llama.cpp's base
    cache); a relative whose window moved on (it decoded further) shares those, and the sequence's own cells from
    there on carry its window (the stress driver: a member restored whole beside a sibling one token ahead, 96 cells
    where 8 would do, and the call outgrew a 256-cell pool)."""
    n_swa = pool.model.n_swa
    return max(0, extent - n_swa + 1) if n_swa > 0 else extent


def _window_kept(pool: Any, relative: Any, extent: int, n: int) -> bool:
    """True unless a sliding window's cells a sequence of ``extent`` positions reads next lie below ``n`` and
    ``relative`` lacks them (see the module docstring)."""
    n_swa = pool.model.n_swa
    if n_swa <= 0:
        return True
    need = max(0, extent - n_swa + 1)  # the first position the next decode after the end attends to
    if n <= need:
        return True
    return gaps.held(pool, relative.id, need, n)  # (not broken, from need on, none given away: gaps.py)
