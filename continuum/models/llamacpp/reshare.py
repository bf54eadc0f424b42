"""A restored fork family shares its prefix again (issue 56: "nothing refused that fits").

A fork family (samples or beams of one state) shares its prefix's cells while resident (``seq_cp``: a bit per cell).
Spilled, each member is written as its own bytes, the shared prefix in each (llama.cpp's per-sequence state API has
no other form), so restored apart the family took n times the prefix's cells: one that fitted resident was refused
("no room to restore a spilled state", found by the long oracle on a 256-cell pool). :func:`reshare` runs after each
restore: the prefix the restored sequence holds in common with a resident relative (the same content: the cells'
origins, through any number of spills and restores, ``cells.content``) is bit for bit the same, so its copy is
dropped and the relative's shared. The relative is any resident sequence: one restored before it, or one that was
never spilled (a running call held it while the idle members went). The peak is one extra member's prefix, for the
moment between its bytes and the drop.

* The batch-invariant mode: the dropped copy is kept by the zombie id like every drop (no hole opens below a live
  cell), and the sequence's cells stay in position order (the relative's bytes were written before its own, below).
* Sliding windows (Gemma 3): ``seq_rm``/``seq_cp`` act on both of llama.cpp's caches; the base cache holds every
  position, the window cache only the window behind each restored end. The relative's window cells replace the
  sequence's own below the cut, so the relative must hold the window the sequence's next decode reads
  (``pos_min`` at most ``extent - n_swa + 1`` where the cut reaches into that window): otherwise it is not reshared.
* Hybrids (recurrent state): not reshared (``seq_cp`` copies the latest recurrent summary, which would replace the
  restored sequence's own).
"""

from __future__ import annotations

from typing import Any

from . import cells
from ._lib import lib

__all__ = ["reshare", "MIN_CELLS"]

MIN_CELLS = 16  # a shorter common prefix is not worth two llama calls


def reshare(pool: Any, seq: Any) -> bool:
    """After resident ``seq`` (a ``Seq`` of ``pool``) was restored from bytes (``cells.restored``), share the longest
    prefix it holds in common with a resident relative (``cells.content``). Under the model's lock. Returns True if
    it did."""
    model = pool.model
    if model.hybrid:
        return False
    held = cells.content(seq)
    best, n = None, 0
    for other in pool.resident.values():
        if other is seq:
            continue
        m = cells.common_prefix(held, cells.content(other))
        if m > n and _window_kept(pool, other, seq, m):
            best, n = other, m
    if best is None or n < MIN_CELLS:
        return False
    pool.drop(seq.id, 0, n)
    if pool.zombie is not None:
        pool.zombie_cells += n
    lib().llama_memory_seq_cp(model.memory, best.id, seq.id, 0, n)
    cells.forked(best, seq, n)
    seq.lineage, seq.lin_end = tuple(held), seq.extent  # (what it holds is unchanged: only where)
    pool.reshared += 1
    return True


def _window_kept(pool: Any, relative: Any, seq: Any, n: int) -> bool:
    """True unless a sliding window's cells ``seq`` reads next lie below ``n`` and ``relative`` lacks them (see the
    module docstring)."""
    n_swa = pool.model.n_swa
    if n_swa <= 0:
        return True
    need = max(0, seq.extent - n_swa + 1)  # the first position the next decode after seq's end attends to
    return n <= need or int(lib().llama_memory_seq_pos_min(pool.model.memory, relative.id)) <= need
