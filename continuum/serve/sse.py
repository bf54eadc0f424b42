"""Server-sent events, and the bridge from a worker thread (where a reply is generated) to the event loop.

A streamed reply runs in ONE thread from start to end (its call is one of the model's engine, which
runs the calls of all threads in one step). The thread puts events on an
asyncio queue; when the client disconnects, the response's body iterator is closed, which sets the
cancel flag: the thread stops at its next token, leaving the decoding loop (its rows freed).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

__all__ = ["DONE", "ThreadStream", "sse"]

DONE = "data: [DONE]\n\n"


def sse(data: Any, event: str | None = None) -> str:
    """One event: ``event: <name>`` (Responses) and ``data: <json>``."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n"


class ThreadStream:
    """Runs ``work(emit, cancelled)`` in a thread; ``emit(x)`` sends ``("event", x)`` to the async side,
    then ``("done", result)`` or ``("error", exception)`` ends the stream."""

    def __init__(self, work: Callable[[Callable[[Any], None], Callable[[], bool]], Any]):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._stop = threading.Event()
        # in a copy of the request's context, as anyio's worker threads run (its arrival time: serve/queue.py)
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._main, work), daemon=True,
                                        name="continuum-stream")
        self._thread.start()

    def _put(self, item: tuple) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self._stop.set()

    def _main(self, work) -> None:
        try:
            result = work(lambda x: self._put(("event", x)), self._stop.is_set)
            self._put(("done", result))
        except BaseException as exc:  # noqa: BLE001 - handed to the async side, which answers with an error body
            self._put(("error", exc))

    async def get(self) -> tuple[str, Any]:
        return await self._queue.get()

    def cancel(self) -> None:
        self._stop.set()

    async def items(self, first: tuple[str, Any] | None = None) -> AsyncIterator[tuple[str, Any]]:
        """Every item up to and including the final one (``done`` or ``error``); cancels the work when closed early."""
        try:
            item = first if first is not None else await self.get()
            while True:
                yield item
                if item[0] != "event":
                    return
                item = await self.get()
        finally:
            self.cancel()
