"""A llama.cpp state's KV as the backend protocol's handle (:class:`continuum.models.kv.KVHandle`): one
:class:`~.sequences.KVView` per row (a view of a llama.cpp sequence: forks and slices share cells) and the layout
columns it covers (``cols``: which of the state's cached columns are real tokens, so a crop by columns maps to a
view of that many positions). Every operation returns a new handle; views are immutable.

Example:
    >>> kv = state._kv                                   # a SeqKV, on a models.llamacpp state    # doctest: +SKIP
    >>> kv.crop(10).views[0].n_tokens                    # the first 10 columns: a shorter view  # doctest: +SKIP
"""

from __future__ import annotations

import torch

from ...errors import BackendError, ContinuumError
from . import recurrent
from .sequences import KVView

__all__ = ["SeqKV"]


class SeqKV:
    """The KV of a batch of rows on llama.cpp: a view per row and the cached columns of the rows' layout.

    ``cols`` is a bool ``(rows, columns)`` tensor: column ``j`` of row ``r`` holds a real (cached) token. Row ``r``'s
    view covers ``cols[r].sum()`` positions. Every method returns a new ``SeqKV``; views are immutable.
    """

    __slots__ = ("views", "cols")

    def __init__(self, views: list[KVView], cols: torch.Tensor):
        self.views, self.cols = views, cols

    def __repr__(self) -> str:
        return f"SeqKV(rows={len(self.views)}, columns={self.cols.shape[1]}, {self.views!r})"

    def length(self) -> int:
        return int(self.cols.shape[1])

    def select_rows(self, rows: torch.Tensor) -> SeqKV:
        idx = rows.tolist()
        return SeqKV([self.views[i] for i in idx], self.cols[rows.to(self.cols.device)])

    def crop(self, columns: int) -> SeqKV | None:
        if columns <= 0:
            return None
        if columns >= self.length():
            return self
        out = self.cut(self.cols[:, :columns])
        return out if out.length() else None  # (a hybrid's rows with no usable summary: recompute from the start)

    def keep(self, mask: torch.Tensor) -> SeqKV:
        """Only the columns ``mask`` (``(rows, columns)``) marks real: each row's view cut where its real columns
        first differ from ``mask``'s, so no later token attends to a cut token's cells.

        A cut that keeps a prefix of a row's cached tokens (``state[..., :n]``) maps exactly to a shorter view; a
        cut in the middle leaves the view ending before it (the state must recompute the tokens after it).

        Example:
            >>> kv.keep(torch.tensor([[True, True, False]]))   # a row of 3 cached tokens -> a view of 2   # doctest: +SKIP
        """
        mask = mask.bool().cpu()
        differ = self.cols != mask
        if not bool(differ.any()):
            return self
        width = self.cols.shape[1]
        first = torch.where(differ.any(1), differ.long().argmax(1), width)  # each row's first differing column
        return self.cut(self.cols & (torch.arange(width)[None, :] < first[:, None]))

    def cut(self, cols: torch.Tensor) -> SeqKV:
        """The KV of ``cols`` (each row's real columns a prefix of its own): each view shortened to its row's count.
        On a hybrid model, cut further back (every row) to where each row's recurrent summary can be had
        (:func:`.recurrent.usable`): the state recomputes the columns after it."""
        if self.views and self.views[0].pool.model.hybrid:
            cols = _recurrent_cut(self.views, cols)
        keep = cols.sum(1).tolist()
        return SeqKV([v if n == v.n_tokens else v.slice(int(n)) for v, n in zip(self.views, keep)], cols)

    def matching(self, mask: torch.Tensor) -> SeqKV:
        """This KV for a forward whose cached columns are ``mask``: views cut to the real columns (:meth:`keep`);
        a :class:`~continuum.errors.BackendError` where ``mask`` has real cached tokens the views lack (never a
        result computed against the wrong cells)."""
        out = self.keep(mask)
        if out is not self and not torch.equal(out.cols, mask.bool().cpu()):
            bad = (out.cols != mask.bool().cpu()).any(1).nonzero().flatten().tolist()
            raise BackendError(f"rows {bad}: the attention mask marks cached tokens the llama.cpp KV does not hold "
                               f"(a column cut in the middle of the cache): recompute the state from its tokens, "
                               f"e.g. SequenceState.from_prompts(model, list(state))")
        return out

    def narrow(self, rows: int, lead: int) -> SeqKV:
        return SeqKV(self.views[:rows], self.cols[:rows, lead:])

    def settle(self) -> SeqKV:
        """The KV a call hands to its result state. On a hybrid model each row's recurrent summary is kept at the
        state's end (a snapshot, once per position), so continuing the state twice, or after its sequence moved
        on, restores it instead of recomputing."""
        if self.views and self.views[0].pool.model.hybrid:
            recurrent.keep_ends(self.views[0].pool, self.views)
        return self

    def nbytes(self, seen: set | None = None) -> int:
        """Bytes of the cells the views reach, each sequence counted once (its longest view): an upper bound, since
        cells a fork shares with its parent sequence (``seq_cp``) are counted in both."""
        seen = set() if seen is None else seen
        per_token = getattr(self.views[0].pool, "kv_bytes_per_token", 0) if self.views else 0
        longest: dict[int, int] = {}
        for v in self.views:
            s = getattr(v, "seq", None)
            if s is not None and id(s) not in seen:
                longest[id(s)] = max(longest.get(id(s), 0), v.n_tokens)
        seen.update(longest)
        seqs = {id(v.seq): v.seq for v in self.views if v.seq is not None and id(v.seq) in longest}
        snaps = sum(len(b) for q in seqs.values() for b in q.snaps.values())  # (a hybrid's recurrent snapshots)
        return per_token * sum(longest.values()) + snaps

    @classmethod
    def stack(cls, kvs: list, width: int, reserve: int = 0) -> SeqKV:
        views: list[KVView] = []
        parts = []
        for kv in kvs:
            if kv is None:
                raise ContinuumError("cannot stack a llama.cpp KV with rows that have none")
            pad = width - kv.length()
            parts.append(torch.nn.functional.pad(kv.cols, (pad, 0)))
            views.extend(kv.views)
        return SeqKV(views, torch.cat(parts))


def _recurrent_cut(views: list[KVView], cols: torch.Tensor) -> torch.Tensor:
    """``cols`` cut (at one column for every row: the layout stays a rectangle) until each row's real count is a
    position where its recurrent summary can be had (its sequence's end or a snapshot)."""
    while cols.shape[1]:
        counts = cols.sum(1).tolist()
        use = [recurrent.usable(v.seq, int(n)) for v, n in zip(views, counts)]
        if use == counts:
            break
        ranks = cols.long().cumsum(1)  # the column holding each row's u-th real token, plus one (0 for u = 0)
        ends = [0 if u == 0 else int((ranks[r] < u).sum()) + 1 for r, u in enumerate(use)]
        cols = cols[:, :min(ends)]
    return cols
