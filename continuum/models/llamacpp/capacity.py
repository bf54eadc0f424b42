"""The llama.cpp pool's side of the capacity model (``continuum.models.capacity``): its cells and ids now, and what
one engine request adds in its step. Read by the scheduler before every step under the model's lock (cheap: one
pass over the resident sequences)."""

from __future__ import annotations

from ..capacity import Capacity
from ..request import Request
from . import cells, window
from .seq import Seq
from .sequences import SequencePool

__all__ = ["capacity", "step_need", "request_seqs", "restore_cells", "row_cells", "rows_cells", "costly_rows"]


def request_seqs(requests: list[Request]) -> dict[int, Seq]:
    """The sequences the requests' KV views are on (by identity)."""
    out: dict[int, Seq] = {}
    for r in requests:
        for v in getattr(r.kv, "views", None) or ():
            seq = getattr(v, "seq", None)
            if seq is not None:
                out[id(seq)] = seq
    return out


def capacity(pool: SequencePool, requests: list[Request]) -> Capacity:
    """The pool's cells and ids, ``requests``' sequences counted as held (the running calls' KV: never spilled)."""
    with pool.model.lock:
        pool.collect()
        held = [s for s in request_seqs(requests).values() if s.id is not None]
        return Capacity(total=cells.total(pool), used=cells.used(pool), held=cells.count(held),
                        ids_total=pool.n_ids, ids_held=len(held))


def restore_cells(v) -> int | None:
    """Cells making view ``v``'s positions available takes where its sequence is spilled (:func:`~.cells.restore_need`:
    the view's own where its bytes can be cut at it, else all the sequence's); None where it is not spilled."""
    s = getattr(v, "seq", None)
    if s is None or s.id is not None or s.blob is None:
        return None
    return cells.restore_need(s, v.n_tokens, window.holds(s.pool.model, s, v.n_tokens))


def step_need(request: Request) -> int:
    """Cells ``request`` adds to the pool in its step: each row's new tokens (a token tree's nodes), and what every
    spilled sequence it continues takes restored (all its positions, or the view's own where a decode forks them
    from the cut bytes: ``window.fork_spilled``). Forks of resident cells add none (shared)."""
    new = request.rows * request.new
    if request.allowed is not None and request.ids is not None:
        new = int(request.ids.numel())  # (a tree's nodes, padded: an upper bound)
    restore: dict[int, int] = {}
    for v in getattr(request.kv, "views", None) or ():
        need = restore_cells(v)
        if need is not None:
            restore[id(v.seq)] = max(restore.get(id(v.seq), 0), need)
    return new + sum(restore.values())


def row_cells(kv) -> int:
    """The most cells one row of a state on ``kv`` (a ``SeqKV``) takes resident while a call continues it: its view's
    positions, or where its sequence is spilled what the restore writes (:func:`~.cells.restore_need`: all of a
    hybrid's positions, and a sliding window's where the cut bytes would lack the view's window)."""
    out = 0
    for v in getattr(kv, "views", None) or ():
        need = restore_cells(v)
        out = max(out, v.n_tokens if need is None else need)
    return out


def rows_cells(kv, rows: list[int]) -> int:
    """Cells ``rows`` of ``kv`` (a ``SeqKV``; a prompt's samples) take together resident: their resident sequences'
    cells, a shared cell once (a fork family's common prefix: :func:`~.cells.count`); spilled ones restored whole,
    their common content once (``reshare`` shares it again; not on hybrids, whose restores are apart); a view forked
    from cut bytes, its own positions. (An upper bound: a restore may also share a resident relative's cells.)"""
    views = getattr(kv, "views", None) or ()
    resident: dict[int, Seq] = {}
    whole: dict[int, Seq] = {}
    apart: dict[int, int] = {}
    for i in rows:
        v = views[i]
        s = getattr(v, "seq", None)
        if s is None or v.n_tokens == 0:
            continue
        need = restore_cells(v)
        if need is None:
            resident[id(s)] = s
        elif need == s.extent and not s.pool.model.hybrid:
            whole[id(s)] = s
        else:
            apart[id(s)] = max(apart.get(id(s), 0), need)
    shared = cells.count(whole.values(), runs=cells.content) if whole else 0
    return cells.count(resident.values()) + shared + sum(v for k, v in apart.items() if k not in whole)


def costly_rows(kv, spilled: bool = False) -> list[int]:
    """Rows of ``kv`` (a ``SeqKV``) cheaper in cells to compute from their tokens than to bring back, for a call that
    found no room running alone: a view of a spilled sequence whose bytes cannot be cut at it (:func:`~.window.holds`);
    on a hybrid every row with cells, since its fork family members restore apart, each with its own copy of their
    common prefix (``reshare`` cannot share a recurrent sequence's cells), where rows computed together decode their
    common prefix once (``prefill.py``). ``spilled``: every row of a spilled sequence (the next try, when none is
    costly): a call is priced with a fork family's common prefix once (:func:`rows_cells`), but on a sliding-window
    model a member whose resident relative no longer holds the window cells its next decode reads is restored whole
    (``reshare``'s window rule), and the call outgrows the pool; computed from their tokens, the rows decode their
    common prefix once (the stress driver: 2 x 2 samples of 90- and 98-token states on a 256-cell pool, 187 cells in
    use when the 96-token member's whole bytes were refused; its sibling's window had moved one position on)."""
    out = []
    for i, v in enumerate(getattr(kv, "views", None) or ()):
        s = getattr(v, "seq", None)
        if s is None or v.n_tokens == 0:
            continue
        need = restore_cells(v)
        if s.pool.model.hybrid or (need or 0) > v.n_tokens or (spilled and need is not None):
            out.append(i)
    return out
