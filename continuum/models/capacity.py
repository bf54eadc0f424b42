"""What a backend has room for: the capacity model the scheduler plans each step with (``continuum.loop.scheduler``).

A backend with a fixed KV pool (llama.cpp: ``n_ctx`` cells and at most 256 sequence ids shared by every live state)
answers :meth:`Backend.capacity` with a :class:`Capacity` and :meth:`Backend.step_need` with the cells one request
adds in its step. A backend without one (transformers: tensors allocated as needed; its bound is the byte budget
``kv_budget``, counted by the scheduler itself) answers ``None``.

Example:
    >>> cap = model.capacity(held)                      # doctest: +SKIP
    >>> cap.room                                        # cells a step may still take (spilling idle states)
    318
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Capacity"]


@dataclass(frozen=True)
class Capacity:
    """A fixed pool's room, in its units (cells), at a step boundary.

    Attributes:
        total: cells of the pool (``n_ctx``).
        used: cells the resident states hold (cells shared by forks counted once).
        held: of those, cells the running calls' requests hold (never spilled to make room).
        ids_total: sequence ids (rows resident at once).
        ids_held: ids the running calls' requests hold.
    """

    total: int
    used: int
    held: int
    ids_total: int
    ids_held: int

    @property
    def room(self) -> int:
        """Cells a step's new tokens may take: the free ones plus those idle states free when spilled."""
        return self.total - self.held
