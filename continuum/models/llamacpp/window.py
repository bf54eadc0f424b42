"""Sliding-window states on llama.cpp (Gemma 3: ``n_swa > 0``): keeping them extendable, and finding those that are not.

A decode at position ``n`` needs the sequence's cells from ``n - n_swa + 1`` on (:func:`fits`);
llama.cpp decodes without them and returns wrong logits. Cells go missing in one way: a spilled sequence's bytes
(``llama_state_seq_get_data``) hold only the window behind the sequence's END, so once restored, any view of it cut
back behind that end cannot be extended. What follows:

* :func:`cut_tail` before a spill: a sequence's dead tail (positions no live view reaches: rejected speculative
  drafts, tokens past a stop string) is cut first, so its bytes hold the window behind the longest live view, and
  that view stays extendable after the restore. (Found by issue 56: 2 of 8 conversations served with
  ``--speculate lookup`` got 400 ``StaleWindowError``.)
* :func:`trim`, on every model: a dead tail is cut as soon as the longest view reaching it is dropped (its cells
  free at once, not only at a spill; a spilled sequence's bytes are cut too, :func:`cut_spilled`, where they hold
  every position).
* :func:`stale` at a call's setup: the rows that still cannot be extended (a slice behind a restored window) are
  recomputed from their tokens by the caller (``continuum.loop.decoding``), never refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ...errors import BackendError, KVCacheFullError, StaleWindowError
from . import cells, gaps, recurrent, reshare, seqbytes
from ._lib import lib

__all__ = ["fits", "gone", "check_cut", "check_lost", "cut_tail", "holds", "cut_spilled", "trim", "stale"]


def fits(pool: Any, seq_id: int, n: int) -> bool:
    """True if a decode at position ``n`` of sequence ``seq_id`` finds every cell it must attend to."""
    if pool.model.hybrid:  # (its pos_min is the recurrent summary's position; no window: recurrent.py)
        return int(lib().llama_memory_seq_pos_max(pool.model.memory, seq_id)) >= n - 1
    need = max(0, n - pool.model.n_swa + 1) if pool.model.n_swa > 0 else 0
    return gaps.held(pool, seq_id, need, n)  # (behind the end: cells given away, gaps.py)


def gone(pool: Any, rows: list[int]) -> StaleWindowError:
    """The error for ``rows`` of a decode or a token tree found at planning to lack window cells (:func:`fits`),
    raised once their forks are undone: their callers recompute them from their tokens."""
    return StaleWindowError(
        f"rows {rows}: the sliding-window cells behind their end are gone (a fork, slice or rewind behind the "
        f"{pool.model.n_swa}-token window, or a window-only blob): recompute these states from their tokens", rows=rows)


def cut_tail(pool: Any, seq: Any, n: int) -> None:  # (a SequencePool and its Seq: sequences.py imports this module)
    """Cut resident ``seq`` back to its first ``n`` positions (a tail no live view reaches; under the model's lock)."""
    before = cells.used(pool)
    check_cut(pool, seq, n, seq.extent)
    cells.cut(seq, n)
    if pool.model.hybrid:  # (llama.cpp cannot cut a recurrent summary back: restore the snapshot)
        recurrent.rewind(pool, seq, n)
    else:
        pool.drop(seq.id, n, -1)
    seq.extent = n
    pool.zombie_cells += before - cells.used(pool) if pool.zombie is not None else 0


def check_cut(pool: Any, seq: Any, n: int, end: int) -> None:
    """Before resident ``seq`` (``end`` positions) is cut back to ``n``: the window behind ``n`` becomes the window
    behind its end, which :func:`fits` no longer probes; cells llama.cpp gave away from it meanwhile (:mod:`.gaps`)
    mark the sequence ``broken``, and every view of it is then recomputed, never extended over the gaps."""
    if pool.probe is not None and n < end and not gaps.intact(pool, seq.id, max(0, n - pool.model.n_swa + 1), n, end):
        seq.broken = True


def check_lost(pool: Any, rows: Iterable[tuple[int, Any, int]]) -> None:
    """After a decode that failed for room was cut back (:func:`check_cut` first): :class:`StaleWindowError` naming the
    rows ``(row, seq, n)`` whose sequence lacks window cells its next decode at ``n`` reads. A decode runs in chunks;
    an earlier chunk extending a sequence moves its end on, so the window cells behind its old end are masked for it
    and llama.cpp may give them to a later chunk's tokens. Decoded again over the gaps after the spill that made room,
    its logits were silently wrong (the long oracle, window-8 GGUF: an option's log-prob 4 nats off); such rows are
    recomputed by their callers instead."""
    lost = sorted({i for i, seq, n in rows if not fits(pool, seq.id, n)})
    if lost:
        raise StaleWindowError(f"rows {lost}: their sliding-window cells went to other tokens of a decode that failed "
                               "for room (no free KV cell): recompute these states from their tokens", rows=lost)


def trim(pool: Any, seqs: Iterable[Any]) -> None:
    """Cut each resident ``seq`` back to its longest live view, once a longer one was dropped: a dropped state's
    cells come back even while an earlier state of its line is held (the oracle: a 2-row state generated to the
    context, dropped, left its 1023 cells in use and the pool full). A hybrid's sequence is cut only where its
    recurrent summary can be restored (a snapshot there)."""
    for seq in seqs:
        end = seq.longest
        if seq.id is not None and seq.holders and seq.extent > end and (not pool.model.hybrid or end in seq.snaps):
            cut_tail(pool, seq, end)
        elif seq.id is None and seq.blob is not None and seq.holders and seq.extent > end:
            cut_spilled(pool, seq, end)


def holds(model: Any, seq: Any, n: int) -> bool:
    """Whether spilled ``seq``'s bytes, cut at ``n`` (:func:`cut_spilled`, :func:`fork_spilled`), still hold every
    cell a view of ``n`` positions reads: not on a hybrid (the recurrent summary is at the old end); on a
    sliding-window model only where the window behind ``n`` is in them. llama.cpp writes a window cache's cells that
    are not masked behind the sequence's last position, and ``find_slot`` may already have given the oldest of those
    to other tokens: a sequence of exactly ``n_swa`` positions may lack position 0 (the stress driver: a 1-token view
    of an 8-token spilled sequence, window 8, forked from the cut bytes without it, its next tokens' log-probs off
    by up to 14 nats). Read from the bytes themselves (:func:`~.seqbytes.positions`)."""
    if model.hybrid:
        return False
    if model.n_swa <= 0 or seq.extent < model.n_swa:  # (no cell of it was ever masked)
        return True
    if seq.held is None or seq.held[0] is not seq.blob:
        seq.held = (seq.blob, seqbytes.positions(seq.blob) if seq.blob is not None else None)
    held = seq.held[1]
    need = np.arange(max(0, n - model.n_swa + 1), n)
    return held is not None and all(np.isin(need, h).all() for h in held)


def fork_spilled(pool: Any, src: Any, n: int, pinned: list) -> Any:
    """A new resident sequence holding spilled ``src``'s first ``n`` positions, written from its bytes cut at ``n``
    (``src`` stays spilled, its longer views with it): a decode that forks a short view of a long spilled state
    restores ``n`` cells, not all of them (the long oracle: "no room to restore a spilled state of 128 tokens" for
    7-token views on 256 cells, their sequences extended to 128 by states still held). None where the bytes cannot be
    cut: the caller restores ``src`` and shares its cells. Under the model's lock."""
    if src.id is not None or src.blob is None or n >= src.extent or not holds(pool.model, src, n):
        return None
    blob = seqbytes.cut(src.blob, n)
    if blob is None:
        return None
    seq = pool.new_seq(pinned)
    try:
        relative, m = reshare.restore(pool, seq.id, blob, cells.below(cells.content(src), n), n, [seq, *pinned])
    except BackendError as exc:
        pool.release_id(seq.id)
        seq.id = None
        raise KVCacheFullError(
            f"no room to restore {n} tokens of a spilled state (n_ctx={pool.model.n_ctx} cells shared by every live "
            "state): load the model with a larger n_ctx, or keep fewer states alive") from exc
    seq.extent = n
    cells.copied(src, seq, n)
    pool.restores += 1
    reshare.settle(pool, seq, relative, m)  # (a resident relative of the same content shares its cells)
    return seq


def cut_spilled(pool: Any, seq: Any, n: int) -> None:
    """Cut spilled ``seq``'s bytes back to its first ``n`` positions (its longest view was dropped after the spill):
    restored whole, they took cells no view reaches, so a restore that fitted was refused, and the scheduler priced
    it at its old extent. Left whole where the cut bytes would not hold what a view of ``n`` reads (:func:`holds`:
    hybrids, a sliding window's cells behind the end; :func:`stale` reads that end), and where llama.cpp's bytes are
    in a layout :func:`~.seqbytes.cut` does not read."""
    if not holds(pool.model, seq, n):
        return
    blob = seqbytes.cut(seq.blob, n)
    if blob is not None:
        cells.cut(seq, n)
        seq.blob, seq.extent = blob, n


def stale(pool: Any, views: Sequence[Any]) -> list[int]:
    """Indices of the ``views`` a decode could not extend (their window cells are gone), restoring nothing: a
    resident sequence is asked llama.cpp; a spilled one is stale when cut back behind the end its bytes were
    written at (they hold only the window behind it)."""
    model = pool.model
    if model.n_swa <= 0 or model.hybrid:
        return []
    out = []
    with model.lock:
        pool.collect()
        for i, view in enumerate(views):
            seq = view.seq
            if seq is None or view.n_tokens == 0:
                continue
            if seq.id is not None:
                ok = fits(pool, seq.id, view.n_tokens)
            else:  # (a sequence cut back over gaps before its spill is still broken: gaps.py)
                ok = not seq.broken and (view.n_tokens >= seq.extent or holds(model, seq, view.n_tokens))
            if not ok:
                out.append(i)
    return out
