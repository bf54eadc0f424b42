"""A call submitted to the engine: the handle its caller waits on (one event; a stream's queue)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator
from typing import Any

from ..models.request import Request
from . import cancel

__all__ = ["Call", "END"]

END = object()  # the last item a stream's queue receives


class Call:
    """One decoding loop submitted to the engine (a handle for its caller)."""

    __slots__ = ("closed", "done", "error", "event", "gen", "grow", "key", "kv", "order", "parked", "pending", "queue",
                 "result", "rows", "steps", "token")

    def __init__(self, gen: Generator, first: Request, rows: int, stream: bool, key: Any, kv: int = 0,
                 grow: int | None = None):
        self.gen, self.pending, self.rows, self.key, self.kv = gen, first, rows, key, kv
        self.grow = grow  # the most cells its rows may add (rows x max_tokens; None: unbounded), for a fixed pool
        self.steps = 0  # steps run (the scheduler's estimate of what it still may add)
        self.token = cancel.current()  # bound while the engine runs this loop: its own Ctrl-C / progress
        self.queue: queue.SimpleQueue | None = queue.SimpleQueue() if stream else None
        self.event = threading.Event()
        self.done = self.closed = False
        self.parked = False  # admitted, but out of the steps until the pool has room (continuum.loop.scheduler)
        self.order = 0  # admission number: the newest is parked first
        self.result: Any = None
        self.error: BaseException | None = None
