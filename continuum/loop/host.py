"""``run_batch``'s calling thread, idle while its workers run the programs, drives the engines' steps.

On a CPU, torch (and llama.cpp) run each operation on an OpenMP team of the calling thread. libgomp counts the
threads of every team a live thread ever made, and once they outnumber the cores it stops spinning between
parallel regions, so every operation wakes its team through the kernel. Measured here (2 cores, 2 torch
threads): the same list call took 0.2 s from the main thread alone and 0.45 s from a worker thread once the
main thread had computed; a thread that computed makes every other one slower for as long as it lives. The
caller of ``run_batch`` has usually computed already (loading the model, a first call), and it waits anyway: so
while it hosts, every step of every engine runs in it, and the workers' calls (:class:`~.engine.Engine`'s
``wait`` and ``forward``) hand their steps over instead of driving in their own threads. One team computes,
as in a lone call or a list call.

A host serves only the thread that hosts: a nested ``run_batch`` (its caller is a worker) or a second one in
another thread while one hosts leaves it to the host there is. When the host stops (its ``run_batch`` ended, or
Ctrl-C), what is left runs on each engine's own thread, as without a host.

The host also runs whole calls (:meth:`Host.run`): when a lockstep ``run_batch`` has one call out and nothing
else (every instance in one joint call, B22b's stages), that call runs here and drives its own steps, so its
setup and finish do not compute on a second thread (a call thread's torch operations start a second OpenMP team:
B22b-128's choice stage took 25-50 ms more than the same list call, its regex stage 15-20 ms more, at 2 threads).
While it runs, an engine asking for a driver gets its own thread instead (:meth:`take`).

Example:
    >>> with HOST.hosting() as hosting:        # doctest: +SKIP
    ...     while not done.is_set():
    ...         hosting.serve(0.1)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Host", "HOST"]


class Host:
    """The thread driving the engines for ``run_batch``'s workers, if any (see the module)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._thread: int | None = None
        self._pending: list[Any] = []  # engines with work and no driver, in the order they asked
        self._tasks: list[Callable[[], Any]] = []  # whole calls to run in the hosting thread (run)
        self._busy = False  # the host runs one of them now: engines asking meanwhile drive on their own thread

    @property
    def active(self) -> bool:
        """Whether a thread hosts and can drive now (while it runs a call of its own, :meth:`run`, the engines'
        own threads drive: an engine whose call the host's Ctrl-C left behind must finish closing it)."""
        return self._thread is not None and not self._busy

    def is_host(self) -> bool:
        """Whether this thread hosts (it drives its own calls' steps: it never hands them to itself)."""
        return self._thread == threading.get_ident()

    def run(self, fn: Callable[[], Any]) -> bool:
        """Run ``fn()`` in the hosting thread, at its next :meth:`serve` (True), or False when none hosts."""
        with self._cond:
            if self._thread is None:
                return False
            self._tasks.append(fn)
            self._cond.notify_all()
            return True

    @contextmanager
    def hosting(self) -> Iterator[Host | None]:
        """Host while the body runs (yields self), or yields None when another thread hosts already."""
        me = threading.get_ident()
        with self._cond:
            if self._thread is not None:
                mine = False
            else:
                self._thread, mine = me, True
        try:
            yield self if mine else None
        finally:
            if mine:
                with self._cond:
                    self._thread = None
                    left, self._pending = self._pending, []
                    tasks, self._tasks = self._tasks, []
                for engine in left:  # (their own threads take over; one with no work left sleeps until _wake)
                    engine._wake()
                for fn in tasks:  # (Ctrl-C before they ran: each on a thread of its own, as a call thread would)
                    threading.Thread(target=fn, name="continuum-call", daemon=True).start()

    def take(self, engine: Any) -> bool:
        """``engine`` has work and nobody drives it: the host will (True), or there is no host (False)."""
        with self._cond:
            if not self.active:
                return False
            if engine not in self._pending:  # (the host itself, releasing with work left: served next round)
                self._pending.append(engine)
            self._cond.notify_all()
            return True

    def nudge(self) -> None:
        """Wake the host (its run_batch may be over)."""
        with self._cond:
            self._cond.notify_all()

    def serve(self, timeout: float, done: threading.Event) -> None:
        """Drive every engine that asked, until none has work, and run the calls handed over (:meth:`run`); else
        sleep up to ``timeout`` (or until ``done``)."""
        with self._cond:
            if not self._pending and not self._tasks and not done.is_set():
                self._cond.wait(timeout)
            engines, self._pending = self._pending, []
            tasks, self._tasks = self._tasks, []
        for engine in engines:
            engine._drive_pending()
        for fn in tasks:
            with self._cond:
                self._busy = True
            try:
                fn()
            finally:
                with self._cond:
                    self._busy = False


HOST = Host()
