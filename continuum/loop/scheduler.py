"""The scheduler: before every step, ONE decision of what runs (vLLM v1's ``Scheduler`` beside ``EngineCore``).

The engine (``engine.py``) executes; this module decides. Before each step :meth:`Scheduler.plan` reads the
backend's capacity (``model.capacity``: a fixed pool's cells held, in use and free, shared cells once;
``continuum.models.capacity``) and what each request will add (``model.step_need``: new tokens per row, token tree
nodes, spilled states to restore), and returns a :class:`Plan`::

    running calls ──▶ 1. fit the running: park the newest while their step needs more cells than the pool has
    (oldest first)        (vLLM's policy: the newest waits, so the oldest finish)
    one-off requests ─▶ 2. run the one-offs that fit (choice scoring's tree, a prefill); the others wait a step
    parked calls ────▶ 3. resume the oldest parked while each fits with what it may still add (``remaining``:
                          rows x the max_tokens it has left) beside what the running may still add
    the inbox ───────▶ 4. admit in arrival order while nothing is parked and each fits: rows (``max_rows``), the
                          byte budget (``kv_budget``, each call at its longest), cells with what it may add
    nothing runs? ───▶ the oldest parked call, else the first waiting call, runs alone (a call that cannot fit
                          alone gets its own clear error: nothing else can make room for it)

A backend without a fixed pool (transformers) has no cells to plan: only rows and the byte budget admit, and
nothing is ever parked. Room in a fixed pool is made from idle states only (user-held states between calls,
parked calls: least recently used family first, only as much as the step needs, ``models/llamacpp/cells.py``).

A decode that still finds no room (fragmentation: the count said it fitted) is the exception path
(:meth:`Scheduler.victim`): the engine parks the newest running call and runs the failed requests again;
``stats()["no_room"]`` counts those failures, ``parked`` the parks (``no_room / parked``: the decodes per park).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import KVCacheFullError, SequencesExhaustedError
from ..models.request import Request
from .call import Call

__all__ = ["DEFAULT_MAX_ROWS", "GROWTH_STEPS", "Plan", "Scheduler", "no_room", "remaining"]

DEFAULT_MAX_ROWS = 256
GROWTH_STEPS = 8  # steps of growth a call of unbounded length admitted or resumed must have room for


def remaining(call: Call, horizon: int | None = None) -> int:
    """Cells ``call`` may still add after this step: its rows times the ``max_tokens`` it has not run yet, at most
    ``horizon`` steps of them (None: all); a call without ``max_tokens``: ``GROWTH_STEPS`` steps of its rows, then
    nothing (the plan parks it if it outgrows the pool). Admission reserves them: with no horizon a call admitted
    with ``max_tokens`` is never parked for growing (vLLM without preemption where the length is known)."""
    if call.grow is None:
        return max(0, GROWTH_STEPS - call.steps) * call.rows
    left = max(0, call.grow - call.steps * call.rows)
    return left if horizon is None else min(left, horizon * call.rows)


def no_room(error: BaseException | None) -> bool:
    """Whether a request failed for want of room in the pool (cells or sequence ids), not for what it asked."""
    return isinstance(error, (KVCacheFullError, SequencesExhaustedError))


@dataclass
class Plan:
    """One step's decision: calls admitted from the inbox, parked, resumed; one-off requests run now."""

    admit: list[Call] = field(default_factory=list)
    park: list[Call] = field(default_factory=list)
    resume: list[Call] = field(default_factory=list)
    oneoff: list[Request] = field(default_factory=list)

    def __repr__(self) -> str:
        return (f"Plan(admit={len(self.admit)}, park={len(self.park)}, resume={len(self.resume)}, "
                f"oneoff={len(self.oneoff)})")


class Scheduler:
    """The decision (see the module docstring); its caller (the engine) holds its lock around :meth:`plan`."""

    def __init__(self, model: Any, max_rows: int = DEFAULT_MAX_ROWS):
        self.model = model
        self.max_rows = max_rows
        self.admitted = 0  # calls admitted so far: a call's number orders "newest"
        self.rows = 0  # the running calls' rows
        self.kv = 0  # and their KV bytes at their longest (for kv_budget)
        self.horizon: int | None = None  # steps of growth reserved at admission (None: up to max_tokens)

    @property
    def kv_budget(self) -> int | None:
        return getattr(self.model, "kv_budget", None)  # (the model's own setting: one source of truth)

    # -- the plan -----------------------------------------------------------------------------------------------
    def plan(self, running: list[Call], inbox: list[Call | Request]) -> Plan:
        """What the next step runs (the inbox and running lists are read, not changed; :meth:`apply` applies)."""
        plan = Plan()
        live = sorted((c for c in running if not c.parked and not c.closed), key=lambda c: c.order)
        parked = sorted((c for c in running if c.parked and not c.closed), key=lambda c: c.order)
        calls = [c for c in inbox if isinstance(c, Call)]
        oneoffs = [r for r in inbox if isinstance(r, Request)]
        measure: Any = getattr(self.model, "capacity", None)
        cap = measure([c.pending for c in live]) if measure is not None else None
        if cap is None:  # no fixed pool: rows and the byte budget, nothing parks
            plan.oneoff = oneoffs
            plan.admit = self._by_budget(calls, bool(parked), live)
            return plan
        need = self.model.step_need
        taken = sum(need(c.pending) for c in live)
        while len(live) > 1 and taken > cap.room:  # 1. the running must fit: the newest waits
            victim = live.pop()
            plan.park.append(victim)
            taken -= need(victim.pending)
            cap = measure([c.pending for c in live])
        held = [c.pending for c in live]  # (what the step will hold: never spilled to make room for it)
        reserved = sum(remaining(c, self.horizon) for c in live)  # (what the running may still add: admissions leave it free)
        for r in oneoffs:  # 2. one-offs that fit now (the first, when nothing else runs: always)
            trial, n = measure(held + [r]), need(r)
            if taken + n <= trial.room or not held:
                plan.oneoff.append(r)
                held.append(r)
                taken += n
        if not plan.park:  # 3. parked calls come back oldest first, each with room to grow
            for c in parked:
                trial, n = measure(held + [c.pending]), need(c.pending)
                if taken + n + reserved + remaining(c, self.horizon) > trial.room and held:
                    break  # (in order: the oldest parked comes back first)
                plan.resume.append(c)
                held.append(c.pending)
                taken, reserved = taken + n, reserved + remaining(c, self.horizon)
        if len(plan.resume) < len(parked):
            return plan  # (no admission while anyone is parked: everyone waits in arrival order)
        rows = self.rows - sum(c.rows for c in plan.park)
        for c in calls:  # 4. the inbox, in arrival order
            trial, n = measure(held + [c.pending]), need(c.pending)
            fits = rows + c.rows <= self.max_rows and taken + n + reserved + remaining(c, self.horizon) <= trial.room \
                and self._budget_ok(live + plan.admit + [c])
            if not fits and held:
                break  # (a call that waits keeps the later ones waiting: no starvation of a large call)
            plan.admit.append(c)
            held.append(c.pending)
            rows, taken, reserved = rows + c.rows, taken + n, reserved + remaining(c, self.horizon)
        return plan

    @staticmethod
    def slab_bytes(calls: list[Call]) -> int:
        """The KV bytes ``calls`` reach decoding together, as the step lays them out: one slab whose every row is as
        long as the longest (``models/hf/merge.py``), each call at its longest (input plus ``max_tokens``). Summing
        each call at its own length instead let one long document beside 60 short chats hold ~23x the budget."""
        rows = sum(c.rows for c in calls)
        return rows * max((c.kv // max(c.rows, 1) for c in calls), default=0)

    def _budget_ok(self, calls: list[Call]) -> bool:
        budget = self.kv_budget
        return budget is None or self.slab_bytes(calls) <= budget

    def _by_budget(self, calls: list[Call], parked: bool, live: list[Call]) -> list[Call]:
        """Admission without a pool: in arrival order while rows and the byte budget (the step's slab, at the
        longest) allow; a call larger than either runs when it is alone."""
        chosen: list[Call] = []
        rows = self.rows
        for c in calls:
            if parked or (rows and (rows + c.rows > self.max_rows or not self._budget_ok(live + chosen + [c]))):
                break
            chosen.append(c)
            rows += c.rows
        return chosen

    def apply(self, plan: Plan, running: list[Call], inbox: list[Call | Request], stats: dict) -> list[Call | Request]:
        """Apply ``plan``: number and add the admitted calls to ``running``, mark parks and resumes; returns the inbox
        left waiting."""
        for c in plan.admit:
            c.order, self.admitted = self.admitted, self.admitted + 1
        running.extend(plan.admit)
        self.rows += sum(c.rows for c in plan.admit)
        self.kv += sum(c.kv for c in plan.admit)
        live = [c for c in running if not c.closed]
        stats["peak_running_kv_bytes"] = max(stats["peak_running_kv_bytes"], self.slab_bytes(live) if plan.admit else 0)
        for c in plan.park:
            c.parked = True
        for c in plan.resume:
            c.parked = False
        stats["parked"] += len(plan.park)
        stats["resumed"] += len(plan.resume)
        taken = {id(x) for x in plan.admit} | {id(x) for x in plan.oneoff}
        return [x for x in inbox if id(x) not in taken]

    def ended(self, call: Call) -> None:
        """``call`` left the running calls (done, failed or closed)."""
        self.rows -= call.rows
        self.kv -= call.kv

    # -- the exception path -------------------------------------------------------------------------------------
    @staticmethod
    def victim(live: list[Call]) -> Call | None:
        """The call to park when a decode found no room although the plan said it fitted: the most recently admitted
        of those not parked, if another is left (a call alone that finds no room cannot fit at all)."""
        candidates = [c for c in live if not c.parked]
        return max(candidates, key=lambda c: c.order) if len(candidates) > 1 else None
