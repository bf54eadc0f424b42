"""Who runs the engine's steps (a mixin of :class:`~continuum.loop.engine.Engine`): the caller's own thread while it
is the only one (a lone call costs no thread hop), else the engine's daemon thread, which sleeps on a condition while
nothing runs; and failing every call when the engine itself breaks. The step itself is ``Engine._step``."""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Any

from ..errors import ContinuumError
from ..models.request import Request
from .arrivals import ARRIVALS, GATE
from .call import Call
from .host import HOST
from .omp import one_thread, release_team

__all__ = ["Driving", "never_drive"]

IDLE_EXIT_S = 0.05  # how long the engine's thread waits for work before it leaves (see Driving._serve)
LOOK_S = 0.005  # how often the idle engine's thread looks whether another thread computes (then it frees its team)
_ENGINES: weakref.WeakSet = weakref.WeakSet()  # engines whose thread was started (stopped at interpreter exit)
_local = threading.local()


def never_drive() -> None:
    """This thread (a long-lived pool's: asyncio's workers, a server's) never runs the engines' steps itself: they
    run on each engine's own thread (or the run_batch host), so the threads computing stay few (see ``_hop``); its
    own tensor operations (stacking and splitting joint calls' rows) run on one thread, so it makes no OpenMP team
    of its own beside the computing thread's (:mod:`.omp`)."""
    _local.never = True
    one_thread()


def _stop_all() -> None:
    for engine in list(_ENGINES):
        engine._stop()


class Driving:
    """The driving half of the engine (its attributes are the engine's: ``_cond``, ``_driver``, ``_thread``,
    ``_running``, ``_inbox``, ``_closing``, ``scheduler``; its steps ``_step``; its calls' ends ``_end``)."""

    _cond: threading.Condition
    _driver: int | None
    _thread: threading.Thread | None
    _running: list[Call]
    _inbox: list[Call | Request]
    _closing: bool
    _ranks: Any
    scheduler: Any

    def _step(self) -> None:
        raise NotImplementedError

    def _end(self, call: Call, result: Any, error: BaseException | None, wake: bool = True) -> None:
        raise NotImplementedError

    def _until_done(self, item: Call | Request, drive: bool) -> None:
        """Run steps until ``item`` is done (this thread drives), or sleep on its event until it is."""
        if not drive:
            item.event.wait()
            return
        try:
            with GATE.exempt():
                while not item.done:
                    self._step()
        finally:
            self._release()

    def _has_work(self) -> bool:
        return bool(self._running or self._inbox)

    def _release(self) -> None:
        """The inline driver stops; the engine's thread takes over if calls remain."""
        with self._cond:
            self._driver = None
            more = self._has_work()
            self._cond.notify_all()
        if more:
            self._wake()

    def _stop(self) -> None:
        """At interpreter exit: let the engine's thread finish its step and leave (a daemon thread killed
        inside a torch op aborts the process)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def _wake(self) -> None:
        if HOST.take(self):  # (run_batch's calling thread drives: loop/host.py)
            return
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                if not _ENGINES:
                    atexit.register(_stop_all)
                _ENGINES.add(self)
                self._thread = threading.Thread(target=self._serve, name="continuum-engine", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _serve(self) -> None:
        """The engine's thread: drive while calls run and nobody else drives; sleep otherwise, and leave after
        ``IDLE_EXIT_S`` with nothing to drive (``_wake`` starts another when calls come back).

        Why it leaves: on a CPU, torch and llama.cpp run each operation on an OpenMP team of the calling thread, and
        while two threads that computed live (this one after acalls, streams or a server's requests; the caller's
        own thread, which drives its lone calls), libgomp stops spinning between parallel regions, so every operation
        of either wakes its team through the kernel. Measured here (2 cores): a lone stories260K call in the main
        thread took 1.7 ms before two acalls and 5.6 ms after them for as long as this thread lived (1.6 ms once it
        had left); Gemma 3 270M on llama.cpp decoded 17% slower beside a live thread that had computed."""
        me = threading.get_ident()
        while True:
            with self._cond:
                leave = time.monotonic() + IDLE_EXIT_S  # (another thread's steps notify too: they do not count as work)
                released = self._ranks is not None
                while not (self._has_work() and self._driver is None and not HOST.active):
                    if self._closing:
                        return
                    now = time.monotonic()
                    if now >= leave and self._ranks is None:
                        if self._thread is threading.current_thread():
                            self._thread = None  # (a call that comes now starts another: _wake, under this lock)
                        return
                    if not released and (HOST.active or self._driver not in (None, me)):
                        release_team()  # another thread computes meanwhile (run_batch's host, a lone call driving
                        released = True  # inline): this one's team goes, so that one team is alive while it does
                    self._cond.wait(None if self._ranks is not None else min(leave - now, LOOK_S))
                self._driver = me
            try:
                self._steps_while_work()
            except BaseException as exc:  # noqa: BLE001  (a bug in the engine itself: fail every call, keep serving)
                self._fail_all(exc)
            finally:
                with self._cond:
                    self._driver = None
                    self._cond.notify_all()

    @staticmethod
    def _hop() -> bool:
        """Whether this thread leaves the steps to another (the waiter asks with ``_wake()`` once its call or request
        is in the inbox, then sleeps on its event): a run_batch worker while its caller hosts (loop/host.py), and a
        pool thread (``acall``, the server's requests: :func:`never_drive`), whose OpenMP team would otherwise
        live on beside the engine's and slow every thread's operations (host.py says why)."""
        if HOST.is_host():  # (a call the host runs itself: HOST.run)
            return False
        return (HOST.active and ARRIVALS.in_program()) or getattr(_local, "never", False)

    def _steps_while_work(self) -> None:
        """Steps, in this thread (the driver), until no call is left."""
        with GATE.exempt():
            while True:
                self._step()
                with self._cond:
                    if not self._has_work():
                        return

    def _drive_pending(self) -> None:
        """Run steps until no call is left, in this thread (run_batch's host), unless someone drives already."""
        with self._cond:
            if self._driver is not None or not self._has_work():
                return
            self._driver = threading.get_ident()
            self._cond.notify_all()  # (an idle engine thread frees its OpenMP team while this one computes: _serve)
        try:
            self._steps_while_work()
        except Exception as exc:  # noqa: BLE001  (a bug in the engine itself: fail every call, as its thread does)
            self._fail_all(exc)
        finally:
            self._release()

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            calls, self._running = self._running, []
            pending, self._inbox = self._inbox, []
            self.scheduler.rows = self.scheduler.kv = 0
        for c in calls + [c for c in pending if isinstance(c, Call)]:
            c.gen.close()
            self._end(c, None, ContinuumError(f"the engine failed while running this call: {exc!r}"))
        for r in pending:
            if isinstance(r, Request):
                r.error, r.done = ContinuumError(f"the engine failed: {exc!r}"), True
                r.event.set()

    @staticmethod
    def _fail_oneoff(requests: list[Request], exc: BaseException) -> None:
        """Wake the one-off requests a failed step admitted, each with an error (their callers wait on them)."""
        for r in requests:
            if not r.done:
                err = ContinuumError(f"the engine failed while running this request: {exc!r}")
                err.__cause__ = exc
                r.error, r.done = err, True
                r.event.set()

