"""``run_batch``'s instances as greenlets on one thread, their calls gathered into joint calls at each step.

::

    runner thread: instance 1 ─▶ instance 2 ─▶ ... ─▶ instance N     (each runs until its next continuum call: parked)
                        │ nobody left to run: the parked calls go out, grouped (loop/coalesce.key_of)
                        ▼
    call threads:  one joint call per cohort (greedy, same generator and arguments), one call each for the rest
                   (the one call out, when it is the only one: in run_batch's caller, which drives the steps)
                        │ a call ends: its instances are runnable again, with their own rows of the result
                        ▼
    runner thread: the instances resumed, one after another ...

A thread per instance made every instance's Python wake on its own: after a joint call of 128 rows, 128 threads
took the GIL in turns for their ``state + text`` and their next call's entry (~0.5 ms each where the work is
~0.2 ms: the GIL's hand-offs, each torch operation one), 60-70 ms per stage in B22b. Here an instance's Python runs
to its next call and switches to the next instance in a few microseconds, and a cohort is complete by construction
(everyone who could join has run: no gathering window to wait out). The calls themselves run on threads, as a
plain call does (each its setup, its wait on the engine's steps, its finish), so a sampling call, a remote call or
a call alone still overlaps the others and shares the engine's steps.

What runs on the runner thread is the programs' own code. A program that blocks there (a web request, a sleep)
holds every instance meanwhile: ``run_batch(..., threads=True)`` runs each instance on its own thread instead. A
``run_batch`` nested in a program runs on a call thread while its instance waits.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from ..loop import coalesce
from ..loop.arrivals import ARRIVALS, GATE, Handoff
from ..loop.cancel import Cancelled, CancelToken, bound, swap
from ..loop.driving import never_drive

try:
    import greenlet
except ImportError:  # pragma: no cover  (a platform without its wheel: run_batch uses a thread per instance)
    greenlet = None

__all__ = ["AVAILABLE", "Batch", "Lockstep", "current"]

AVAILABLE = greenlet is not None


def current() -> Instance | None:
    """The program instance running in this greenlet, or None (not inside a lockstep ``run_batch``)."""
    if greenlet is None:
        return None
    g = greenlet.getcurrent()
    return g if isinstance(g, Instance) else None


class _Job:
    """A parked instance's call: ``fn(state)``; ``key`` groups it with others into one joint call (None: alone)."""

    __slots__ = ("instance", "key", "generator", "state", "fn")

    def __init__(self, instance: Instance, key: tuple | None, generator: Any, state: Any, fn: Callable[[Any], Any]):
        self.instance, self.key, self.generator, self.state, self.fn = instance, key, generator, state, fn


if greenlet is not None:
    class Instance(greenlet.greenlet):
        """One program instance: ``program(x)`` for input ``index``; ``token`` is its slot's (cancellation, progress)."""

        def __init__(self, runner: Lockstep, token: CancelToken, slot: bool, index: int, x: Any):
            super().__init__(parent=runner.hub)
            self.runner, self.token, self.index, self.x = runner, token, index, x
            self.slot = slot  # (token is a slot's, reused by the next instance; an acall's own is not)

        def run(self) -> None:  # (greenlet's entry point)
            self.runner.batch.run_one(self.index, self.x)

        def call(self, key: tuple | None, generator: Any, state: Any, fn: Callable[[Any], Any]) -> Any:
            """Park until ``fn(state)`` ran (jointly with the calls of the same ``key`` parked meanwhile); its result."""
            self.runner.parked.append(_Job(self, key, generator, state, fn))
            return self.runner.hub.switch()

        def offload(self, fn: Callable[[], Any]) -> Any:
            """Park while ``fn()`` runs on a call thread (a nested ``run_batch``: it waits for threads of its own)."""
            return self.call(None, None, None, lambda _: fn())
else:  # pragma: no cover
    Instance = type(None)  # type: ignore[misc,assignment]


class Batch(Protocol):
    """What a :class:`Lockstep` runs: ``run_batch``'s :class:`~continuum.programs.batch._Run`, or the acalls one
    event-loop iteration started (:mod:`.aio`)."""

    limit: int  # the most instances at once

    def next_input(self) -> tuple[int, Any] | None:
        """The next ``(index, x)`` to start an instance on, or None."""

    def token_of(self, x: Any) -> CancelToken | None:
        """The instance's own cancellation token (an ``acall``'s), or None: a slot token (:meth:`new_token`)."""

    def new_token(self) -> CancelToken:
        """A new slot token (its cancellation a child of the run's; its progress count read by the run)."""

    def run_one(self, index: int, x: Any) -> None:
        """Instance ``index``: run it on ``x`` and keep its result or error (never raises)."""


class Lockstep:
    """The runner of one :class:`Batch`, in the runner thread."""

    def __init__(self, batch: Any):
        self.batch = batch
        self.hub: Any = None
        self.ready: deque = deque()  # (instance, result, error) to switch into, in order
        self.parked: list[_Job] = []
        self.ended: queue.SimpleQueue = queue.SimpleQueue()  # (jobs, outcomes) of calls that ended
        self.running = 0  # calls out on the call threads
        self.alive = 0  # instances started and not finished
        self.free: list[CancelToken] = []  # slot tokens of finished instances (progress counts stay per slot)

    def run(self) -> None:
        self.hub = greenlet.getcurrent()
        pool = ThreadPoolExecutor(max_workers=self.batch.limit, thread_name_prefix="continuum-call")
        try:
            # in a program (its calls may join: coalesce.key_of), arriving while instances run; the gate is for
            # threads taking turns on the GIL, and this one thread runs every instance's Python in turn
            with ARRIVALS.program(), GATE.exempt():
                while self.alive < self.batch.limit and self._start():
                    pass
                done = getattr(self.batch, "round_done", None)
                while True:
                    self._run_ready()
                    if done is not None:
                        done()
                    self._dispatch(pool)
                    if not self.running:
                        break
                    ARRIVALS.arrived()  # (waiting for calls: not on the way to one)
                    self._resume(*self.ended.get())
                    while not self.ended.empty():
                        self._resume(*self.ended.get())
                    ARRIVALS.arrive()
        finally:
            pool.shutdown(wait=False)

    def _start(self) -> bool:
        """Start one more instance on the next input (pulled only now), if there is one."""
        item = self.batch.next_input()
        if item is None:
            return False
        own = self.batch.token_of(item[1])
        token = own or (self.free.pop() if self.free else self.batch.new_token())
        self.alive += 1
        self.ready.append((Instance(self, token, own is None, *item), None, None))
        return True

    def _run_ready(self) -> None:
        """Switch into every runnable instance until each has parked on a call or finished."""
        while self.ready:
            inst, result, error = self.ready.popleft()
            if inst.token.cancelled and error is None:
                error = Cancelled()
                if not inst:  # (never started: nothing to unwind)
                    self._finished(inst)
                    continue
            previous = swap(inst.token)  # (the instance's own Python checks it, e.g. in check_cancelled)
            try:
                if error is not None:
                    inst.throw(error)
                elif inst:
                    inst.switch(result)
                else:
                    inst.switch()  # (its start: run() takes no argument)
            finally:
                swap(previous)
            if inst.dead:
                self._finished(inst)

    def _finished(self, inst: Instance) -> None:
        self.alive -= 1
        if inst.slot:
            self.free.append(inst.token)
        self._start()

    def _dispatch(self, pool: ThreadPoolExecutor) -> None:
        """Send the parked calls out: one joint call per key, up to its row cap, each other call alone. The only
        call out goes to the batch's ``inline`` where it has one (run_batch: its caller runs it and drives its steps,
        loop/host.py), else each goes to a call thread."""
        calls: list[list[_Job]] = []
        cohorts: dict[tuple, list[_Job]] = {}
        for job in self.parked:
            if job.key is None:
                calls.append([job])
            else:
                cohorts.setdefault(job.key, []).append(job)
        self.parked = []
        for jobs in cohorts.values():
            cap, rows = coalesce.cap(jobs[0].generator), 0
            chunk: list[_Job] = []
            for job in jobs:
                if chunk and rows + job.state.rows > cap:
                    calls.append(chunk)
                    chunk, rows = [], 0
                chunk.append(job)
                rows += job.state.rows
            calls.append(chunk)
        inline = getattr(self.batch, "inline", None)
        for jobs in calls:
            handoff = Handoff()  # (counted as on its way to the engine from now: the step about to run waits for it)
            self.running += 1
            if not (len(calls) == 1 and self.running == 1 and inline is not None
                    and inline(lambda h=handoff, j=jobs: self._call(h, j, inline=True))):
                pool.submit(self._call, handoff, jobs)

    def _call(self, handoff: Handoff, jobs: list[_Job], inline: bool = False) -> None:
        """On a call thread (or the batch's ``inline`` thread): the jobs' call(s), each outcome (result, error) to
        the runner."""
        if not inline:
            never_drive()  # (the steps run on the host, run_batch's caller, or the engine's own thread: driving.py)
        first = jobs[0].instance.token
        # a call alone stops with its instance; a joint call once all of its instances are cancelled (an acall
        # cancelled alone just drops its rows of the result)
        token = first if len(jobs) == 1 else _AllOf([j.instance.token for j in jobs])
        outcomes: list[tuple[Any, BaseException | None]] = []
        try:
            with bound(token):
                outcomes = handoff.run(lambda: _outcomes(jobs))
        except KeyboardInterrupt:  # (inline: Ctrl-C in run_batch's caller, which raises it; its instances stop)
            outcomes = [(None, Cancelled())] * len(jobs)
            raise
        except BaseException as exc:  # noqa: BLE001  (never lose a parked instance: it gets the error)
            outcomes = [(None, exc)] * len(jobs)
        finally:
            handoff.close()
            self.ended.put((jobs, outcomes))

    def _resume(self, jobs: list[_Job], outcomes: list[tuple[Any, BaseException | None]]) -> None:
        self.running -= 1
        for job, (result, error) in zip(jobs, outcomes):
            self.ready.append((job.instance, result, error))


class _AllOf(CancelToken):
    """A joint call's token: cancelled once every member's is (Ctrl-C on a run, every awaiting task cancelled); the
    tokens it generates are counted to its first member's as they come (run_batch's progress bar reads them live)."""

    __slots__ = ("members",)

    def __init__(self, members: list[CancelToken]):  # (not CancelToken's: its tokens = 0 would reset the member's)
        self._cancelled, self.parent, self.first, self.members = False, None, None, members

    @property
    def cancelled(self) -> bool:
        return self._cancelled or all(t.cancelled for t in self.members)

    @property
    def tokens(self) -> int:
        return self.members[0].tokens

    @tokens.setter
    def tokens(self, value: int) -> None:
        self.members[0].tokens = value


def _outcomes(jobs: list[_Job]) -> list[tuple[Any, BaseException | None]]:
    """Each job's (result, error): one joint call when several, else (or when it failed) each alone."""
    if len(jobs) > 1:
        results = coalesce.joint([j.state for j in jobs], jobs[0].fn)
        if results is not None:
            return [(r, None) for r in results]
    out: list[tuple[Any, BaseException | None]] = []
    for job in jobs:
        if job.instance.token.cancelled:  # (a joint call stopped by Ctrl-C: its members stop too, none runs alone)
            out.append((None, Cancelled()))
            continue
        try:
            out.append((job.fn(job.state), None))
        except KeyboardInterrupt:  # (only where the call runs in run_batch's caller: _call raises it there)
            raise
        except BaseException as exc:  # noqa: BLE001  (to its own instance)
            out.append((None, exc))
    return out
