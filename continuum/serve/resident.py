"""The states a store keeps in memory, by part file, least recently used out past a byte budget."""

from __future__ import annotations

from collections import OrderedDict

from ..models import kv as kvcache
from ..state import SequenceState

__all__ = ["Resident"]


def _nbytes(state: SequenceState) -> int:
    """Bytes a state holds in memory (its cache and token tensors)."""
    tensors = [state._ids, state._mask, state._logprobs]
    return sum(t.numel() * t.element_size() for t in tensors) + kvcache.nbytes(state._kv)


class Resident:
    """States kept in memory by part file, least recently used out past ``budget`` bytes (a state larger than the
    budget is not kept). Not locked: its store calls it under its own lock."""

    def __init__(self, budget: int):
        self.budget = budget
        self._states: OrderedDict[str, tuple[SequenceState, int]] = OrderedDict()
        self._used = 0

    def __contains__(self, file: str) -> bool:
        return file in self._states

    def get(self, file: str) -> SequenceState | None:
        hit = self._states.get(file)
        if hit is None:
            return None
        self._states.move_to_end(file)
        return hit[0]

    def items(self) -> list[tuple[str, SequenceState]]:
        """Each kept ``(file, state)``, least recently used first."""
        return [(file, state) for file, (state, _) in self._states.items()]

    def drop(self, file: str) -> None:
        old = self._states.pop(file, None)
        if old is not None:
            self._used -= old[1]

    def put(self, file: str, state: SequenceState) -> None:
        size = _nbytes(state)
        if size > self.budget:
            return
        self.drop(file)
        self._states[file] = (state, size)
        self._used += size
        while self._used > self.budget and self._states:
            _, (_, freed) = self._states.popitem(last=False)
            self._used -= freed
