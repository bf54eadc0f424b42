"""Room in the model's KV pool: which running calls take part in a step, which wait (the scheduler's decision).

A llama.cpp model has one fixed pool of KV cells and at most 256 sequence ids shared by every live state; a step
whose new tokens find no room fails in the backend (:class:`~continuum.errors.KVCacheFullError`,
:class:`~continuum.errors.SequencesExhaustedError`) after it has spilled every idle sequence (user-held states,
parked calls) to host bytes. The engine does not hand that failure to the calls. It **parks** the most recently
admitted call (vLLM's policy: the newest waits, so the oldest finish) and runs the requests that failed again,
until they fit; a lone call that still finds no room cannot fit at all and gets the error. A parked call keeps its
loop and its pending request; its sequences are spilled as idle ones when room is needed (exact: host bytes,
``llama_state_seq_get_data``) and restored when it runs again. Parked calls come back oldest first, one for each
call that ended (their cells are free again), or all when nothing else runs; new calls are admitted only while
nothing is parked, so everyone waits in arrival order and nobody starves.

Example (what a user sees: every program completes, whatever the pool's size)::

    >>> model = models.llamacpp("stories260K-f32.gguf", n_ctx=512)                  # doctest: +SKIP
    >>> run_batch(lambda p: gen(p, max_tokens=60), prompts * 8)                      # doctest: +SKIP
    >>> model.engine.stats()["parked"]                                              # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import KVCacheFullError, SequencesExhaustedError
from ..models.request import Request
from .call import Call

__all__ = ["no_room", "Room"]


def no_room(error: BaseException | None) -> bool:
    """Whether a request failed for want of room in the pool (cells or sequence ids), not for what it asked."""
    return isinstance(error, (KVCacheFullError, SequencesExhaustedError))


class Room:
    """The parked calls and when they come back (one per engine; its caller holds the engine's lock)."""

    def __init__(self) -> None:
        self.admitted = 0  # calls admitted so far: a call's number orders "newest"
        self.ended = 0  # running calls that ended since calls were last brought back

    def number(self, calls: list[Call]) -> None:
        for c in calls:
            c.order, self.admitted = self.admitted, self.admitted + 1

    @staticmethod
    def parked(running: list[Call]) -> list[Call]:
        return [c for c in running if c.parked]

    def victim(self, live: list[Call]) -> Call | None:
        """The call to park when a step finds no room: the most recently admitted of those not parked yet, if
        another one is left (a call alone that finds no room cannot fit at all)."""
        candidates = [c for c in live if not c.parked]
        return max(candidates, key=lambda c: c.order) if len(candidates) > 1 else None

    def run(self, live: list[Call], oneoff: list[Request], run: Callable[[list[Request]], None],
            hold: Callable[[list[Request]], None], stats: dict) -> list[Call]:
        """Run the step's requests (``run``: the backend's ``run_step``); while some find no room in the model's
        pool, park the most recently admitted call and run the failed ones again. ``hold``: the backend keeps the
        running calls' KV resident meanwhile. Returns the calls whose loops resume now: a parked call whose request
        ran resumes once more and then waits; one whose request failed waits with it, run again when it is back."""
        todo = [c.pending for c in live] + oneoff
        while True:
            hold([c.pending for c in live if not c.parked] + oneoff)  # room is made from everything else first
            try:
                run(todo)
            finally:
                hold([])
            failed = [r for r in todo if no_room(r.error)]
            victim = self.victim(live) if failed else None
            if victim is None:  # (room for all, or a call alone that cannot fit: its error is its own)
                return live
            victim.parked = True
            stats["parked"] += 1
            if victim.pending in failed:
                live = [c for c in live if c is not victim]
            for r in failed:
                r.error = None
            todo = [r for r in failed if r is not victim.pending]
            if not todo:
                return live

    def back(self, running: list[Call]) -> list[Call]:
        """The parked calls to run again now: oldest first, one per call ended since, all when nothing else runs."""
        parked = sorted(self.parked(running), key=lambda c: c.order)
        if not parked:
            self.ended = 0
            return []
        k = len(parked) if len(parked) == len(running) else min(self.ended, len(parked))
        self.ended = 0
        for c in parked[:k]:
            c.parked = False
        return parked[:k]
