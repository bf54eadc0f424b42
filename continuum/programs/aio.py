"""asyncio for generators and chats: ``await g.acall(...)``, ``async for text in g.astream(...)``.

A generator call is a blocking call; here it runs on one of continuum's shared worker threads (a bounded
pool of :data:`ASYNC_WORKERS`; a worker waiting for the engine holds no CPU), so the event loop stays free
and concurrent ``acall``\\ s (``asyncio.gather``) are calls the model's engine runs in one step; greedy calls of
one generator with the same arguments run as ONE list call, as ``run_batch``'s programs do
(:class:`~continuum.loop.arrivals.Handoff`, :mod:`continuum.loop.coalesce`). A stream runs on a worker too and hands
its chunks to the event loop through a queue.

Cancellation is cooperative (:mod:`continuum.loop.cancel`): cancelling the awaiting task, or closing an
async stream (``break`` out of ``async for``, ``aclose()``), stops the call at its next decoding step.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..loop.arrivals import Handoff
from ..loop.cancel import Cancelled, CancelToken, bound, current
from ..loop.driving import never_drive

__all__ = ["ASYNC_WORKERS", "to_thread", "AsyncStream"]

ASYNC_WORKERS = 256
"""The most ``acall``/``astream`` calls running at once (more wait for a free worker; set before the first call)."""

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=ASYNC_WORKERS, thread_name_prefix="continuum-async")
        return _executor


def _call(token: CancelToken, handoff: Handoff, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    never_drive()  # (the engine's own thread computes: loop/driving.py)
    with bound(token):
        return handoff.run(lambda: fn(*args, **kwargs))


async def to_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``await`` ``fn(*args, **kwargs)`` run on a shared worker thread; cancelling the task cancels the call
    at its next decoding step (the ``CancelledError`` is raised at once, the worker leaves right after)."""
    loop = asyncio.get_running_loop()
    token = CancelToken(parent=current())
    handoff = Handoff()  # (calls gathered together run as one list call where they can: loop/coalesce)
    future = loop.run_in_executor(_pool(), functools.partial(_call, token, handoff, fn, args, kwargs))
    try:
        return await future
    except asyncio.CancelledError:
        token.cancel()
        raise
    except Cancelled:  # a parent token was cancelled: a BaseException must not escape into the event loop
        raise asyncio.CancelledError() from None
    finally:
        handoff.close()


def _produce(stream, token: CancelToken, put: Callable[[str, Any], None]) -> None:
    """Iterate the blocking ``stream`` on a worker thread, handing each chunk to the event loop.

    A plain function (not a method of :class:`AsyncStream`): the worker must not keep the async stream
    alive, so that dropping it (``break`` out of ``async for``) cancels the call."""
    never_drive()
    with bound(token):
        try:
            for chunk in stream:
                if token.cancelled:  # closed between two chunks
                    return
                put("chunk", chunk)
            put("end", None)
        except Cancelled:
            return
        except BaseException as exc:  # re-raised by __anext__ in the event loop
            put("error", exc)


class AsyncStream:
    """``async for chunk in gen.astream(...)``: the chunks of the blocking stream, as they are generated.

    Once exhausted, :attr:`state` and :attr:`result` (generator streams) or :attr:`chat` (chat streams)
    are those of the blocking stream. Closing it early (``break`` out of the loop, ``await aclose()``,
    ``async with``, the task cancelled) stops the decoding loop at its next step. After ``break`` the
    stream is closed when it is dropped (at once in CPython); ``await stream.aclose()`` (or
    ``async with gen.astream(...) as stream``) closes it deterministically and waits until the loop left.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._token = CancelToken(parent=current())
        self._queue: asyncio.Queue | None = None
        self._future: Future | None = None
        self._done = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        if self._queue is None:
            self._start()
        assert self._queue is not None
        try:
            kind, item = await self._queue.get()
        except asyncio.CancelledError:
            self._close()
            raise
        if kind == "chunk":
            return item
        self._done = True
        if kind == "error":
            raise item
        raise StopAsyncIteration

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queue = queue

        def put(kind: str, item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, item))
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        self._future = _pool().submit(_produce, self._stream, self._token, put)

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self._token.cancel()

    async def aclose(self) -> None:
        """Stop the stream (if still running) and wait until its decoding loop has left."""
        self._close()
        if self._future is not None:
            try:
                await asyncio.wrap_future(self._future)
            except Exception:  # its error was (or will never be) read: closing does not raise it
                pass

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if not self._done:
            self._token.cancel()

    @property
    def state(self):
        """The final state (once the stream is exhausted)."""
        return self._stream.state

    @property
    def result(self):
        """The final value, as the blocking call would return it (generator streams)."""
        return self._stream.result

    @property
    def chat(self):
        """The chat with the reply (chat streams, once exhausted)."""
        return self._stream.chat
