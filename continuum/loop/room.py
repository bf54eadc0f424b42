"""A step's requests run where the KV pool may lack room: the exception path of the engine's step.

The scheduler's plan counted room before the step (``scheduler.py``); the count can still be short (a restore that
needs more cells than priced, another model's work in the same pool). Then, instead of failing the step:

1. what failed beside other requests runs once more (the others' results are idle now: their cells spillable);
2. still failing, the newest running call is parked (:meth:`Scheduler.victim`) and the rest runs again;
3. one-off requests (a setup's prefill, a choice's tree) that found no room together run one at a time, each beside
   the running calls only; one that still finds no room waits for the next step, at the head of the inbox. Only a
   request that ran with nothing else gets its error: it cannot fit at all.
"""

from __future__ import annotations

from typing import Any

from ..models.request import Request
from .call import Call
from .scheduler import Scheduler, no_room

__all__ = ["execute"]


def execute(model: Any, scheduler: Scheduler, stats: dict, live: list[Call],
            oneoff: list[Request]) -> tuple[list[Call], list[Request]]:
    """Run the plan's requests (``model.run_step``), the running calls' KV held resident meanwhile (see the module
    docstring). Returns the calls whose loops resume now, and the one-offs to put back at the head of the inbox
    (removed from ``oneoff``: not done, their callers keep waiting)."""
    todo = [c.pending for c in live] + oneoff
    again = len(live) + len(oneoff) > 1  # one more try for what failed beside others (below)
    while True:
        # room is made from the rest (a one-off already run is not held: its result is idle until its owner takes it)
        model.hold([c.pending for c in live if not c.parked] + [r for r in oneoff if r in todo])
        try:
            model.run_step(todo, stats)  # the backend's own way (models/protocol.py)
        finally:
            model.hold([])
        failed = [r for r in todo if no_room(r.error)]
        if failed:
            stats["no_room"] += 1
        victim = scheduler.victim(live) if failed else None
        if victim is None and failed and again:
            # what the step's other requests computed is theirs now (a one-off's result, idle): spillable, so a
            # request that failed beside them (a call's restore, "no room to restore a spilled state") may fit now
            again = False
            for r in failed:
                r.error = None
            todo = failed
            continue
        if victim is None:  # (room for all, or a call alone that cannot fit: its error is its own)
            return live, _retry_later(_one_at_a_time(model, stats, live, oneoff, failed), live, oneoff)
        victim.parked = True
        stats["parked"] += 1
        if victim.pending in failed:
            live = [c for c in live if c is not victim]
        for r in failed:
            r.error = None
        todo = [r for r in failed if r is not victim.pending]
        if not todo:
            return live, []


def _one_at_a_time(model: Any, stats: dict, live: list[Call], oneoff: list[Request],
                   failed: list[Request]) -> list[Request]:
    """One-offs that found no room together run one at a time, each held beside the running calls only: together each
    held the others' inputs, which no room could then be made from. (8 parts of a choice, 2 rows each, on a pool of
    16 sequence ids: their 16 rows held every id, no tree could fork its leaves, and the same step came back forever:
    a hang on the LFM2 GGUF, 1 run in ~8.) Returns what still failed."""
    alone = [r for r in failed if r in oneoff]
    if len(alone) < 2:
        return failed
    still = [r for r in failed if r not in oneoff]
    running = [c.pending for c in live if not c.parked]
    for r in alone:
        r.error = None
        model.hold(running + [r])
        try:
            model.run_step([r], stats)
        finally:
            model.hold([])
        if no_room(r.error):
            still.append(r)
    return still


def _retry_later(failed: list[Request], live: list[Call], oneoff: list[Request]) -> list[Request]:
    """The one-offs that found no room beside other requests of the step: they wait for the next step instead of
    failing (what the others hold is freed or parked by then)."""
    crowded = len(live) + len(oneoff) > 1
    again = [r for r in failed if crowded and r in oneoff]
    for r in again:
        r.error, r.result = None, None
        oneoff.remove(r)
    return again
