"""Calls on their way to the engine: its next step waits a little for them.

A call's setup (argument checks, prefix reuse, its rows: :func:`continuum.loop.decoding.decode`) runs in
its caller's thread before the call is submitted. Calls started together (``run_batch``, threads,
``asyncio.gather``, a chain's next call in every program at once) would otherwise reach the engine over
several steps, each late cohort a prefill forward, a KV slab and a join copy of its own. So a thread
counts as *arriving* while it sets up a call, and a ``run_batch`` worker (:meth:`Arrivals.program`)
whenever it runs its program outside the engine (between two calls, before the first): the step about
to run waits while anyone is arriving, at most as long as the last step took (bounded to 1-20 ms),
5 ms more after each arrival while they keep coming (at most 100 ms), and not at all when nobody is
(a lone call, a steady cohort). One count for the process (every model's
engine): a program's next call may go to another model.

Example:
    >>> arrivals = Arrivals()
    >>> arrivals.arrive(); arrivals.count
    1
    >>> arrivals.arrived(); arrivals.count      # (a second arrived() is a no-op)
    0
    >>> arrivals.gather(last_step_s=0.5)       # nobody arriving: returns at once
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

log = logging.getLogger("continuum")
P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["Arrivals", "ARRIVALS", "Handoff", "Gate", "GATE", "gated", "GATHER_MIN_S", "GATHER_CAP_S", "GATHER_NEXT_S",
           "GATHER_MAX_S"]

GATHER_MIN_S, GATHER_CAP_S = 0.001, 0.02  # the bounds of a step's wait for calls on their way
GATHER_NEXT_S = 0.005  # after an arrival, how long the next one is waited for (a thread's start and setup)
GATHER_MAX_S = 0.1  # the longest a step waits while arrivals keep coming
GATE_WAIT_S = 2.0  # the longest a thread waits for the gate before going on without it (Gate._take)


class Arrivals:
    """How many calls are being set up right now (each thread counted once), and the wait for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._local = threading.local()  # whether this thread's setup is counted
        self.count = 0
        self._done = 0  # arrivals so far (a gathering step waits on while this moves)

    def arrive(self) -> None:
        """This thread is setting up a call."""
        if not getattr(self._local, "counted", False):
            self._local.counted = True
            with self._cond:
                self.count += 1

    def arrived(self) -> None:
        """This thread's setup is over (its call submitted, a one-off forward made, a wait for another's
        prefill, an error): the step no longer waits for it."""
        if getattr(self._local, "counted", False):
            self._local.counted = False
            with self._cond:
                self.count -= 1
                self._done += 1
                self._cond.notify_all()  # (a gathering step extends its wait while arrivals keep coming)

    def expect(self) -> None:
        """A thread about to start will arrive (a ``run_batch`` worker being spawned): counted from now; the
        thread takes the count over with :meth:`claim`."""
        with self._cond:
            self.count += 1

    def claim(self) -> None:
        """In the thread :meth:`expect` announced: the count it added is this thread's."""
        if getattr(self._local, "counted", False):
            self.arrived()
        self._local.counted = True

    def forget(self) -> None:
        """A thread announced by :meth:`expect` that will not come (a server request whose worker never started)."""
        with self._cond:
            self.count -= 1
            self._cond.notify_all()

    @contextmanager
    def program(self, patience: float | None = None) -> Iterator[None]:
        """A ``run_batch`` worker runs one program: it is arriving whenever it is not waiting on the engine
        (:meth:`resumed` counts it again after each wait). ``patience``: the longest its calls wait for company
        (:mod:`.coalesce`; None: the default, for a program's lockstep cohorts)."""
        self._local.program = getattr(self._local, "program", 0) + 1
        before = getattr(self._local, "patience", None)
        self._local.patience = patience
        self.arrive()
        try:
            yield
        finally:
            self._local.program -= 1
            self._local.patience = before
            self.arrived()

    def in_program(self) -> bool:
        """Whether this thread runs a ``run_batch`` program (its calls may run as one: :mod:`.coalesce`)."""
        return bool(getattr(self._local, "program", 0))

    def patience(self, default: float) -> float:
        """The longest this thread's call waits for company: its program's ``patience``, else ``default``."""
        mine = getattr(self._local, "patience", None)
        return default if mine is None else mine

    def resumed(self) -> None:
        """This thread woke from a wait on the engine: inside a program, it is on its way to its next call."""
        if self.in_program():
            self.arrive()

    @contextmanager
    def away(self) -> Iterator[None]:
        """This thread waits on something other than the engine (a nested ``run_batch``'s workers): not arriving."""
        counted = getattr(self._local, "counted", False)
        self.arrived()
        try:
            yield
        finally:
            if counted:
                self.arrive()

    def gather(self, last_step_s: float, longest: float = GATHER_MAX_S, after: float = GATHER_NEXT_S) -> None:
        """Wait while calls are arriving: at most ``last_step_s`` (within ``GATHER_MIN_S``-``GATHER_CAP_S``; 0: no
        wait), extended to ``after`` (``GATHER_NEXT_S``) after each arrival while they keep coming (a cohort being set up:
        ``run_batch``'s workers one after another), never past ``longest``. Returns at once when nobody
        is arriving (a lone call's steps never yield: ``sleep(0)`` costs a time slice on a loaded machine)."""
        if not self.count or last_step_s <= 0:
            return
        start = time.perf_counter()
        deadline = start + min(max(last_step_s, GATHER_MIN_S), GATHER_CAP_S)
        with self._cond:
            seen = self._done
            while self.count and (left := deadline - time.perf_counter()) > 0:
                self._cond.wait(left)
                if self._done != seen:  # someone arrived: the others may be right behind
                    seen = self._done
                    deadline = min(max(deadline, time.perf_counter() + after), start + longest)


class Gate:
    """At most ``width`` threads run a call's own Python outside the engine at once (its setup, choice
    scoring's bookkeeping); the others wait for one of its tokens, off the GIL.

    The engine's steps release the GIL at every torch operation; each time, any runnable thread may
    take it for up to the interpreter's switch interval (5 ms). With 128 callers setting up calls at
    once, a step waited for most of them at each operation (steps of 0.5-1 s measured in B22b); with
    the gate it competes with ``width`` of them. Reentrant; released around every wait on the engine
    (:meth:`waiting`), so a holder never blocks a step or another call it needs.
    """

    def __init__(self, width: int = 2) -> None:
        # (a queue of ``width`` tokens, not a threading.Semaphore: its get and put are C, where a semaphore's
        # acquire and release are Python around a condition; every call takes and gives back the gate twice)
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(width):
            self._tokens.put(None)
        self._local = threading.local()
        self._held = _Held(self)

    def held(self) -> _Held:
        """Around a call's own Python: the gate taken (reentrant; nothing to take in an exempt thread)."""
        return self._held

    def _enter(self) -> None:
        local = self._local
        if getattr(local, "exempt", False):  # (a thread running the engine's steps never waits here)
            return
        depth = getattr(local, "depth", 0)
        if not depth:
            self._take()
        local.depth = depth + 1

    def _exit(self) -> None:
        local = self._local
        if getattr(local, "exempt", False):  # (with-blocks nest: exempt now if and only if exempt at _enter)
            return
        local.depth -= 1
        if not local.depth and local.owned:
            self._tokens.put(None)

    def _take(self) -> None:
        """Take the gate, or go on without it after ``GATE_WAIT_S``: a holder blocked on something that needs this
        thread would otherwise hang both (every wait continuum knows of releases the gate; this is the net)."""
        try:
            self._tokens.get(timeout=GATE_WAIT_S)
            self._local.owned = True
        except queue.Empty:
            self._local.owned = False
            log.debug("the gate was not free within %.0f s: going on without it", GATE_WAIT_S)

    def free(self) -> int:
        """How many more threads may take the gate now (for tests)."""
        return self._tokens.qsize()

    @contextmanager
    def exempt(self) -> Iterator[None]:
        """Around a thread's run of the engine's steps: the calls' code it resumes (which may slice or add states)
        does not take the gate, so a step never waits for callers that may wait for it (a model's lock)."""
        before = getattr(self._local, "exempt", False)
        self._local.exempt = True
        try:
            yield
        finally:
            self._local.exempt = before

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait on the engine (or on another call): the gate is free meanwhile."""
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth:
            local.depth = 0
            if local.owned:
                self._tokens.put(None)
        try:
            yield
        finally:
            if depth:
                self._take()
                local.depth = depth


class _Held:
    """:meth:`Gate.held`'s context manager: one object per gate, its state per thread in the gate (a generator-based
    one cost a generator per call)."""

    __slots__ = ("_gate",)

    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    def __enter__(self) -> None:
        self._gate._enter()

    def __exit__(self, *exc: object) -> None:
        self._gate._exit()


class Handoff:
    """A call handed to another thread (``acall``'s worker pool, a server's request threads), counted as on its way
    to the engine from the moment it is handed over, and run there as a ``run_batch`` program is: calls of one
    generator with the same arguments handed over together run as ONE list call (:mod:`.coalesce`; greedy calls
    only, each row what it is alone), and the first one's wait for the others sees those still queued for a thread.

    Example::

        handoff = Handoff()                                  # in the thread that hands the call over
        try:
            result = pool.submit(handoff.run, call).result()
        finally:
            handoff.close()                                  # a worker that never started gives its count back
    """

    __slots__ = ("_lock", "_taken")

    def __init__(self, early: bool = True) -> None:
        """``early``: counted from now (the handing thread); else from the worker's start (a pool that may queue the
        call for long: a server's, whose queued requests would otherwise hold every step's wait at its bound)."""
        self._lock, self._taken = threading.Lock(), not early
        if early:
            ARRIVALS.expect()

    def _take(self) -> bool:
        with self._lock:
            taken, self._taken = self._taken, True
        return not taken

    def run(self, fn: Callable[[], R]) -> R:
        """In the worker: ``fn()``, counted as arriving whenever it is not waiting on the engine. Its call waits for
        company at most ``GATHER_MAX_S``, as a step does: on a busy server someone is nearly always arriving, and a
        call must not wait up to a program cohort's second for calls that may never join it."""
        if self._take():
            ARRIVALS.claim()  # (this worker's from now on)
        with ARRIVALS.program(patience=GATHER_MAX_S):
            return fn()

    def close(self) -> None:
        if self._take():
            ARRIVALS.forget()


ARRIVALS = Arrivals()  # the process's (every engine waits for the same callers)
GATE = Gate()


def gated(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run holding :data:`GATE` (continuum's own Python, few threads at once: no GIL convoy)."""
    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with GATE.held():
            return fn(*args, **kwargs)
    return run
