"""The KV of a hybrid or recurrent model (LFM2, Mamba) on transformers: attention KV plus recurrent snapshots.

A recurrent layer (LFM2's short convolution, Mamba's convolution and SSM) keeps one fixed-size summary per row
instead of one entry per column, so it cannot be cut back the way an attention KV is cropped. :class:`HybridKV`
carries, beside the attention layers' ``(keys, values)`` tuples (the same tensors and functions as any
transformers KV, :mod:`continuum.models.hf.cache`):

* ``mask``: the attention mask of the ``length()`` columns it covers. A recurrent summary at column ``c`` is the
  summary of each row's real tokens in columns ``[0, c)``; ``mask`` says which those are, so a cut that removes a
  summarized token is detected (the summary is then no longer valid past that column);
* ``current``: the recurrent summary at ``length()`` (every row, zeros for a row with no real token yet);
* ``snaps``: earlier summaries (:class:`Snapshot`, ascending columns) a slice may go back to.

Snapshot policy (bounded; docs/hybrid.md): every forward pushes the summary it continued from, as a *recent*
snapshot (the last :data:`RECENT` are kept: a call's final crop drops an end-of-sequence token, a stop string cuts
a few tokens back); a call's end (:meth:`HybridKV.settle`) and its prompt's end (its first forward) are *end*
snapshots (the last :data:`ENDS` are kept: slicing back whole turns of a chat, regenerating a reply); with
``model.snapshot_interval = N``, one summary at least every ``N`` columns a call decodes through is kept too
(the last :data:`EVERY`: slicing into a long generation recomputes at most about ``N`` tokens).
:meth:`HybridKV.crop` to a column that is no snapshot goes back to the nearest snapshot before it: the columns
after it become the state's uncached suffix and are recomputed exactly, never approximated. Forks share
snapshots: a snapshot holds its base tensors and a row index (``rows``), so selecting rows (forks, beam reorders)
copies nothing until a snapshot is used.

Example:
    >>> kv = state._kv                           # on a models.transformers LFM2 state     # doctest: +SKIP
    >>> kv.length(), [s.column for s in kv.snaps]                                          # doctest: +SKIP
    (24, [5, 11, 12])
    >>> kv.crop(12).length(), kv.crop(9).length()   # 12 is a snapshot; 9 goes back to 5  # doctest: +SKIP
    (12, 5)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...errors import RecurrentStateError
from . import cache as _hf

__all__ = ["Snapshot", "HybridKV", "States", "RECENT", "ENDS", "EVERY"]

RECENT = 4  # summaries of the last forwards kept (the final crop of a call, a stop string a few tokens back)
ENDS = 32  # call-end summaries kept (slicing back turns); older ones are dropped: a slice before them recomputes more
EVERY = 32  # interval summaries kept (model.snapshot_interval: one every N columns of a long generation)

States = tuple[tuple[torch.Tensor, ...], ...]  # per recurrent layer: its tensors (conv state[, SSM state]), rows first


@dataclass(frozen=True)
class Snapshot:
    """The recurrent summary of every row at ``column``: row ``r`` is row ``rows[r]`` of ``states`` (``rows`` None:
    the identity). ``end``: a call (or its prompt) ended here; ``every``: kept by the interval (both kept longer
    than the recent ones, see the module docstring)."""

    column: int
    states: States
    rows: torch.Tensor | None = None
    end: bool = False
    every: bool = False

    def take(self) -> States:
        """The states of this snapshot's rows (a copy only when rows were selected)."""
        if self.rows is None:
            return self.states
        return tuple(tuple(t.index_select(0, self.rows.to(t.device)) for t in layer) for layer in self.states)

    def select(self, rows: torch.Tensor) -> Snapshot:
        """The snapshot of rows ``rows`` of this one (no copy: the index is composed)."""
        rows = rows.to("cpu", torch.long)
        return replace(self, rows=rows if self.rows is None else self.rows[rows])

    def nbytes(self, seen: set) -> int:
        total = 0
        for layer in self.states:
            for t in layer:
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
        return total


def _prune(snaps: tuple[Snapshot, ...]) -> tuple[Snapshot, ...]:
    """The snapshots the policy keeps: the last :data:`ENDS` call ends, :data:`EVERY` interval ones and :data:`RECENT`
    others."""
    ends = [s for s in snaps if s.end][-ENDS:]
    every = [s for s in snaps if s.every and not s.end][-EVERY:]
    recent = [s for s in snaps if not s.end and not s.every][-RECENT:]
    keep = {id(s) for s in ends + every + recent}
    return tuple(s for s in snaps if id(s) in keep)


class HybridKV:
    """The KV of a batch of rows of a hybrid/recurrent model (see the module docstring): a
    :class:`~continuum.models.kv.KVHandle`, so the state algebra and the loop treat it as any backend's KV.

    ``attn``: the attention layers' ``(keys, values)`` (columns ``[0, length)``; empty for a pure recurrent model);
    ``mask``: bool ``(rows, length)``; ``current``: the summary at ``length``; ``snaps``: earlier ones.
    Every method returns a new handle and never writes a tensor this one holds.
    """

    __slots__ = ("attn", "mask", "current", "snaps", "settled")

    def __init__(self, attn: _hf.KV | None, mask: torch.Tensor, current: Snapshot, snaps: tuple[Snapshot, ...] = (),
                 settled: bool = False):
        self.attn: _hf.KV = attn or ()
        self.mask, self.current, self.snaps = mask.bool(), current, snaps
        self.settled = settled  # a state's KV (settle), not a running call's: the next forward starts a call

    def __repr__(self) -> str:
        return (f"HybridKV(rows={self.mask.shape[0]}, columns={self.length()}, "
                f"snapshots={[s.column for s in self.snaps]}+[{self.current.column}])")

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    def length(self) -> int:
        return int(self.mask.shape[1])

    def states(self) -> States:
        """The recurrent summary of every row at :meth:`length` (what the next forward continues from)."""
        return self.current.take()

    def select_rows(self, rows: torch.Tensor) -> HybridKV:
        attn = _hf.select_rows(self.attn, rows) if self.attn else self.attn
        return HybridKV(attn, self.mask[rows.to(self.mask.device)], self.current.select(rows),
                        tuple(s.select(rows) for s in self.snaps))

    def crop(self, columns: int) -> HybridKV | None:
        """The first ``columns`` columns, or fewer: the nearest snapshot at or before ``columns`` (None when none)."""
        if columns >= self.length():
            return self
        at = [s for s in self.snaps if s.column <= columns]
        if not at or at[-1].column <= 0:
            return None
        snap = at[-1]
        attn = _hf.crop(self.attn, snap.column) if self.attn else self.attn
        return HybridKV(attn, self.mask[:, :snap.column], snap, tuple(at[:-1]))

    def keep(self, mask: torch.Tensor) -> HybridKV | None:
        """Only the columns ``mask`` marks real: cut back to the last snapshot before the first summarized token
        ``mask`` removes (a summary cannot forget a token; the tokens after the snapshot are recomputed)."""
        mask = mask[:, :self.length()].bool().to(self.mask.device)
        differ = (self.mask != mask).any(0)
        if not bool(differ.any()):
            return self
        return self.crop(int(differ.long().argmax()))

    def narrow(self, rows: int, lead: int) -> HybridKV:
        """The first ``rows`` rows without their first ``lead`` columns (padding in those rows: a summary taken
        within them holds nothing, so such snapshots are dropped and the others move ``lead`` columns left)."""
        first = torch.arange(rows)
        attn = tuple((k[:rows, :, lead:], v[:rows, :, lead:]) for k, v in self.attn)
        moved = tuple(replace(s.select(first), column=s.column - lead) for s in self.snaps if s.column > lead)
        return HybridKV(attn, self.mask[:rows, lead:], replace(self.current.select(first), column=self.length() - lead),
                        moved)

    def settle(self) -> HybridKV:
        """The KV a call hands to its result: its summary marked as a call end (kept by the policy), the attention
        storage compacted (:func:`~continuum.models.hf.cache.compact`)."""
        attn = _hf.compact(self.attn) if self.attn else self.attn
        # snapshots of selected rows get their own storage: one sample of many must not pin all rows' summaries
        own = tuple(s if s.rows is None else replace(s, states=s.take(), rows=None) for s in self.snaps)
        current = replace(self.current, end=True)
        if current.rows is not None:
            current = replace(current, states=current.take(), rows=None)
        return HybridKV(attn, self.mask, current, own, settled=True)

    def advanced(self, attn: _hf.KV, mask: torch.Tensor, states: States, end: bool = False,
                 interval: int | None = None) -> HybridKV:
        """This KV after a forward over more columns: ``attn`` and ``mask`` cover them all, ``states`` is the summary
        at the new end (``end``: kept like a call's end, see :func:`~.hybrid.forward`); the summary it continued
        from becomes a snapshot, kept by the interval when the last kept one is ``interval`` columns back or more."""
        old = self.current
        if interval and not old.end:
            kept = [s.column for s in self.snaps if s.end or s.every]
            if old.column - (kept[-1] if kept else 0) >= interval:
                old = replace(old, every=True)
        snaps = self.snaps + ((old,) if self.length() > 0 else ())
        return HybridKV(attn, mask, Snapshot(mask.shape[1], states, end=end), _prune(snaps))

    def nbytes(self, seen: set | None = None) -> int:
        """Bytes of the attention KV and of every snapshot's tensors, storage shared counted once."""
        seen = set() if seen is None else seen
        total = _hf.nbytes(self.attn, seen) if self.attn else 0
        return total + sum(s.nbytes(seen) for s in (*self.snaps, self.current))

    def snapshot_bytes(self) -> int:
        """Bytes of the recurrent summaries alone (what the snapshots cost beside the attention KV)."""
        seen: set = set()
        return sum(s.nbytes(seen) for s in (*self.snaps, self.current))

    @classmethod
    def stack(cls, kvs: list, width: int, reserve: int = 0) -> HybridKV:
        """The rows of ``kvs`` one after another, right-aligned to ``width`` columns: each row's summary is at the
        new end (leading columns are padding); earlier snapshots are dropped (their columns differ by part)."""
        if any(kv is None for kv in kvs):
            raise RecurrentStateError("cannot stack a recurrent model's KV with rows that have none: recompute "
                                      "those rows' states first (continue them with max_tokens=0)")
        attn = _hf.stack_rows([kv.attn for kv in kvs], width, reserve) if kvs[0].attn else ()
        mask = torch.cat([torch.nn.functional.pad(kv.mask, (width - kv.length(), 0)) for kv in kvs])
        parts = [kv.states() for kv in kvs]
        states = tuple(tuple(torch.cat([p[i][j] for p in parts]) for j in range(len(parts[0][i])))
                       for i in range(len(parts[0])))
        return cls(attn, mask, Snapshot(width, states))

    def gather_paths(self, rows, start, split, index, mask):
        raise RecurrentStateError("a token tree's paths are read from the tree forward's KV (hybrid_tree.TreeKV), "
                                  "not from a state's: run the tree with model.forward(..., allowed=...) first")
