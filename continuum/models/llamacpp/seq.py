"""One llama.cpp sequence's record (:class:`Seq`): what the pool (``sequences.py``) and the modules that decode,
spill, cut and count cells know of a sequence the views share (its id or spilled bytes, its extent, its holders)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from . import cells

__all__ = ["Seq"]


class Seq:
    """One llama.cpp sequence's content, shared by the views that hold it: resident under an id, or spilled."""

    __slots__ = ("pool", "id", "extent", "holders", "blob", "last_use", "snaps", "key", "own_lo", "inherit", "lineage",
                 "lin_end", "broken", "held")

    def __init__(self, pool: Any, seq_id: int | None):  # (a SequencePool: sequences.py imports this module)
        self.pool, self.id = pool, seq_id
        self.extent = 0  # positions 0..extent-1 are in the sequence (its pos_max + 1)
        self.holders: Counter[int] = Counter()  # live views by length
        self.blob: bytes | None = None  # the spilled sequence's bytes when id is None
        self.last_use = 0
        self.snaps: dict[int, bytes] = {}  # a hybrid model's recurrent summaries at earlier positions (recurrent.py)
        self.key, self.own_lo = 0, 0  # where its cells came from (cells.py: shared cells once)
        self.inherit: tuple[tuple[int, int, int], ...] = ()
        self.lineage: tuple[tuple[int, int, int], ...] = ()  # what its cells hold, below lin_end (cells.content)
        self.lin_end = 0
        self.held: tuple[bytes, Any] | None = None  # (blob, the positions it holds): window.holds, read once per blob
        self.broken = False  # a sliding window's cells given away behind an end it was cut back to (window.cut_tail)
        cells.fresh(self)

    @property
    def longest(self) -> int:
        """The length of its longest live view (0: none holds it)."""
        return max(self.holders) if self.holders else 0
