"""Calls being set up in their callers' threads: the engine's next step waits a little for them.

A call's setup (argument checks, prefix reuse, its rows: :func:`continuum.loop.decoding.decode`) runs in
its caller's thread before the call is submitted. Calls started together (``run_batch``, threads,
``asyncio.gather``, a chain's next call in every program at once) would otherwise reach the engine over
several steps, each late cohort a prefill forward, a KV slab and a join copy of its own. While any
setup is under way, the step about to run waits for it: at most as long as the last step took
(bounded to 1-20 ms), not at all when nobody is arriving (a lone call, a steady cohort).

Example:
    >>> arrivals = Arrivals()
    >>> arrivals.arrive(); arrivals.count
    1
    >>> arrivals.arrived(); arrivals.count      # (a second arrived() is a no-op)
    0
    >>> arrivals.gather(last_step_s=0.5)       # nobody arriving: returns at once
"""

from __future__ import annotations

import threading
import time

__all__ = ["Arrivals", "GATHER_MIN_S", "GATHER_CAP_S"]

GATHER_MIN_S, GATHER_CAP_S = 0.001, 0.02  # the bounds of a step's wait for calls being set up


class Arrivals:
    """How many calls are being set up right now (each thread counted once), and the wait for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._local = threading.local()  # whether this thread's setup is counted
        self.count = 0

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
                if not self.count:
                    self._cond.notify_all()

    def gather(self, last_step_s: float) -> None:
        """Wait while calls are being set up, at most ``last_step_s`` (within the bounds; 0: no wait); hand
        the GIL to other threads once otherwise."""
        if not self.count or last_step_s <= 0:
            time.sleep(0)  # threads setting up a call join this step, not a later one
            return
        deadline = time.perf_counter() + min(max(last_step_s, GATHER_MIN_S), GATHER_CAP_S)
        with self._cond:
            while self.count and (left := deadline - time.perf_counter()) > 0:
                self._cond.wait(left)
