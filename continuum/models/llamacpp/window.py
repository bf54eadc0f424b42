"""Sliding-window states on llama.cpp (Gemma 3: ``n_swa > 0``): keeping them extendable, and finding those that are not.

A decode at position ``n`` needs the sequence's cells from ``n - n_swa + 1`` on (``SequencePool._window_ok``);
llama.cpp decodes without them and returns wrong logits. Cells go missing in one way: a spilled sequence's bytes
(``llama_state_seq_get_data``) hold only the window behind the sequence's END, so once restored, any view of it cut
back behind that end cannot be extended. Two things follow:

* :func:`cut_tail` before a spill: a sequence's dead tail (positions no live view reaches: rejected speculative
  drafts, tokens past a stop string) is cut first, so its bytes hold the window behind the longest live view, and
  that view stays extendable after the restore. (Found by issue 56: 2 of 8 conversations served with
  ``--speculate lookup`` got 400 ``StaleWindowError``.)
* :func:`stale` at a call's setup: the rows that still cannot be extended (a slice behind a restored window) are
  recomputed from their tokens by the caller (``continuum.loop.decoding``), never refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import cells, recurrent

__all__ = ["cut_tail", "stale"]


def cut_tail(pool: Any, seq: Any, n: int) -> None:  # (a SequencePool and its _Seq: sequences.py imports this module)
    """Cut resident ``seq`` back to its first ``n`` positions (a tail no live view reaches; under the model's lock)."""
    before = cells.used(pool)
    cells.cut(seq, n)
    if pool.model.hybrid:  # (llama.cpp cannot cut a recurrent summary back: restore the snapshot)
        recurrent.rewind(pool, seq, n)
    else:
        pool.drop(seq.id, n, -1)
    seq.extent = n
    pool.zombie_cells += before - cells.used(pool) if pool.zombie is not None else 0


def stale(pool: Any, views: Sequence[Any]) -> list[int]:
    """Indices of the ``views`` a decode could not extend (their window cells are gone), restoring nothing: a
    resident sequence is asked llama.cpp; a spilled one is stale when cut back behind the end its bytes were
    written at (they hold only the window behind it)."""
    model = pool.model
    if model.n_swa <= 0 or model.hybrid:
        return []
    out = []
    with model.lock:
        pool._collect()
        for i, view in enumerate(views):
            seq = view._seq
            if seq is None or view.n_tokens == 0:
                continue
            if seq.id is not None:
                ok = pool._window_ok(seq.id, view.n_tokens)
            else:
                ok = view.n_tokens >= seq.extent or seq.extent <= model.n_swa
            if not ok:
                out.append(i)
    return out
