"""Rows of one decode that start from the same cells (or none) with the same first new tokens: their common prefix is
decoded once, into one sequence the rows then share (``seq_cp``), instead of once per row.

Found by the stress driver (``tests/test_oracle_stress.py``): three programs of one ``run_batch`` step continued one
state whose sliding-window cells were gone; each recomputed its 78 tokens from nothing in the same decode, 3 x 85
cells of a 256-cell pool, and the step was refused (``KVCacheFullError``) where one copy and three forks fit. Any step
of identical prompts is the same case (programs on one system prompt, a prompt given twice in a list, one document
appended to a state by several calls): the prefix is computed once, as the prefix cache does across calls, here
within one decode and with or without it.

The prefix goes first, in a decode of its own (llama.cpp's batch can give a token several sequence ids, as token
trees do, but rows of different lengths then follow no one chunking rule). It stops one token short of the group's
shortest row, so every row still decodes its last token and gets its logits; a row that asks for logits inside the
prefix ("all", or such indices) is left alone. The results are those of a prefill split in two decodes: within
the tolerance a chunked prefill has (``docs/llamacpp.md``), and exact in the batch-invariant mode.

Example:
    >>> rows = [DecodeRow(pool.empty(), doc + q1), DecodeRow(pool.empty(), doc + q2)]    # doctest: +SKIP
    >>> rows, shared = share(pool, rows, decode)                                          # doctest: +SKIP
    >>> [r.view.n_tokens for r in rows]       # the common prefix, decoded once           # doctest: +SKIP
    [412, 412]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from ..seqprefix import common_prefix

__all__ = ["share", "MIN_TOKENS"]

MIN_TOKENS = 16  # a shorter common prefix is not worth a decode of its own


def share(pool: Any, rows: Sequence[Any], decode: Callable[..., Any]) -> tuple[list[Any], list[Any]]:
    """``rows`` (``DecodeRow`` s) with each group of rows on one view (none: no cells) whose new tokens share a prefix
    of at least :data:`MIN_TOKENS` moved onto one view of that prefix, decoded here by ``decode``; again on the new
    views, so nested prefixes go once each (a short prompt and two long ones that extend it: the short one's
    prefix, then the long ones'). Returns the rows and those views, for the caller to release after its decode.
    Under the model's lock."""
    out: list[Any] = list(rows)
    shared: list[Any] = []
    while True:
        heads: dict[tuple, list[int]] = defaultdict(list)
        for i, row in enumerate(out):
            if len(row.tokens) > MIN_TOKENS and _outside(row.logits, MIN_TOKENS) is not None:
                heads[(id(row.view.seq), row.view.n_tokens, tuple(row.tokens[:MIN_TOKENS]))].append(i)
        moved = False
        for members in heads.values():
            if len(members) < 2:
                continue
            toks = [list(out[i].tokens) for i in members]
            p = min(min(common_prefix(toks[0], t) for t in toks[1:]), min(len(t) for t in toks) - 1)
            wanted = [_outside(out[i].logits, p) for i in members]
            if p < MIN_TOKENS or any(w is None for w in wanted):
                continue
            row = out[members[0]]
            try:
                view = decode(pool, [type(row)(row.view, toks[0][:p], "none")]).views[0]
            except BaseException:
                for made in shared:  # (an earlier group's prefix: nobody will hold it)
                    made.release()
                raise
            shared.append(view)
            for i, t, w in zip(members, toks, wanted):
                out[i] = type(row)(view, t[p:], w)
            moved = True
        if not moved:
            return out, shared


def _outside(logits: Any, p: int) -> Any:
    """The logits wanted of a row's tokens from ``p`` on, if none is wanted before ``p`` (else None)."""
    if isinstance(logits, str):
        return logits if logits in ("last", "none") else None
    idx = list(logits)
    return [i - p for i in idx] if all(i >= p for i in idx) else None
