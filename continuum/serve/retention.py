"""Retention on a schedule of its own: a thread runs the store's pass (``enforce_retention()``) every
``--retention-interval`` seconds, so no request's save waits for a delete (before, every save ran a pass that
scanned every row). Its first pass runs at once, on the thread: a start does not wait for it either.

A pass that fails (the database is failing over) is said once, and retried at the next interval; the server
keeps serving meanwhile. Tests and tools run a pass synchronously: ``store.enforce_retention()``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .redact import redact

__all__ = ["RetentionTimer"]

logger = logging.getLogger("continuum.serve")


class RetentionTimer:
    """Calls ``run()`` now, then every ``interval`` seconds, on a daemon thread, until :meth:`stop`."""

    def __init__(self, run: Callable[[], object], interval: float):
        if interval <= 0:
            raise ValueError(f"a retention interval is > 0 seconds, got {interval}")
        self.run, self.interval = run, interval
        self.passes = 0  # passes completed (tests wait on it)
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._loop, name="continuum-retention", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run()
            except Exception as exc:  # noqa: BLE001 - the next pass retries; serving goes on
                if not self._failing:  # once per outage, not once per interval
                    logger.warning("retention pass failed (%s: %s); retrying every %g s", type(exc).__name__,
                                   redact(exc), self.interval)
                self._failing = True
            else:
                if self._failing:
                    logger.info("retention passes succeed again")
                self._failing = False
                self.passes += 1
            self._stop.wait(self.interval)

    def stop(self, timeout: float = 10.0) -> None:
        """No pass starts after this; waits up to ``timeout`` s for a pass under way to finish (its transaction
        commits or rolls back whole either way)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
