"""The server's queue of replies waiting for the model: what ``--max-queue`` bounds (503 with Retry-After past it).

A reply waits for the model while it waits for a worker thread (``Context.run(..., reply=True)``: non-streamed
replies queue there behind ``worker_threads``) and while its call is in the engine but not decoding (not admitted
yet, or parked for want of room in the KV pool: ``engine.waiting_calls()``). A reply being set up (rendered, its
schema compiled) is not waiting for the model and does not count. A client that leaves frees its place at once
(its wait for a thread is cancelled; a call closed in the inbox leaves it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from ..loop.cancel import CancelToken, bound, current
from .errors import Overloaded

__all__ = ["ADMITTED", "ARRIVAL", "Generation", "ReplyQueue"]

# when the request being served arrived (time.perf_counter(); app.py's outermost middleware sets it, and the worker
# threads that generate see it: anyio's threads and serve/sse.py's copy the request's context). None outside a request.
ARRIVAL: ContextVar[float | None] = ContextVar("continuum_serve_arrival", default=None)
# set in the worker thread of a reply that :meth:`ReplyQueue.enter` admitted to wait: its generation is not refused
# later, when others queued behind it (issue 56: at --max-queue 2, 40 clients, 2 answered where 3 fit)
ADMITTED: ContextVar[bool] = ContextVar("continuum_serve_admitted", default=False)


@dataclass
class Generation:
    """One generation as ``/metrics`` counts it: its token counts (the route sets them when it is done) and when
    its first token came (the engine marks the cancel token its calls run under: ``CancelToken.first``), counted
    from ``start``: the request's arrival, before it waited for a thread or for room in the KV pool."""

    start: float
    token: CancelToken
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.token.first is None else self.token.first - self.start


class ReplyQueue:
    """Counts replies waiting (for a thread; in the engine) and generating; refuses past ``max_queue``."""

    def __init__(self, max_queue: int | None, engine_waiting: Callable[[], int]):
        self.max_queue = max_queue  # replies waiting for the model beyond which a new one is refused (503)
        self.queued = 0  # replies waiting for a worker thread
        self.active = 0  # replies being generated now (GET /health reports it)
        self._engine_waiting = engine_waiting
        self._lock = threading.Lock()
        self.on_generation: Callable[[Generation], None] | None = None  # (/metrics: serve/metrics.py sets it)

    def waiting(self) -> int:
        """Replies waiting for the model: for a worker thread, or in the engine (not admitted yet, or parked)."""
        return self.queued + self._engine_waiting()

    def _refuse_if_full(self) -> None:
        if self.max_queue is not None:
            waiting = self.waiting()
            if waiting >= self.max_queue:
                raise Overloaded(f"the server is busy: {waiting} replies are waiting for the model (--max-queue "
                                 f"{self.max_queue}); retry shortly")

    def enter(self) -> None:
        """A reply is about to wait for a worker thread: counted from now on; refused (:class:`Overloaded`) when
        ``max_queue`` replies already wait."""
        with self._lock:
            self._refuse_if_full()
            self.queued += 1

    def leave(self) -> None:
        """The reply got its worker thread (or its client left before it did)."""
        with self._lock:
            self.queued -= 1

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Counts a generation in :attr:`active` while it runs; refuses it when ``max_queue`` replies already wait, unless
        it was admitted to wait already (:data:`ADMITTED`: a reply that waited is never refused afterwards)."""
        with self._lock:
            if not ADMITTED.get():
                self._refuse_if_full()
            self.active += 1
        try:
            yield
        finally:
            with self._lock:
                self.active -= 1

    @contextmanager
    def generation(self) -> Iterator[Generation]:
        """One generation, counted while it runs (:meth:`busy`); its calls run under a cancel token of its own,
        which marks its first token; reported to ``on_generation`` once it succeeded."""
        arrived = ARRIVAL.get()
        g = Generation(time.perf_counter() if arrived is None else arrived, CancelToken(current()))
        with self.busy(), bound(g.token):
            yield g
        if self.on_generation is not None:
            self.on_generation(g)
