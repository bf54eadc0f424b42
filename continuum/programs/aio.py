"""asyncio for generators and chats: ``await g.acall(...)``, ``async for text in g.astream(...)``.

A generator call is a blocking call; here it runs off the event loop, so the loop stays free. The acalls one
iteration of the loop starts (``asyncio.gather``) run in lockstep on a worker, as ``run_batch``'s instances do
(:class:`_Tick`, :mod:`.lockstep`): greedy calls of one generator with the same arguments run as ONE list call, the
others share the engine's steps. A stream runs on a worker of a bounded pool (:data:`ASYNC_WORKERS`) and hands its
chunks to the event loop through a queue.

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

from ..loop.arrivals import ARRIVALS, Handoff
from ..loop.cancel import Cancelled, CancelToken, bound, current
from ..loop.driving import never_drive
from ..loop.omp import release_team
from .lockstep import AVAILABLE, Lockstep

__all__ = ["ASYNC_WORKERS", "to_thread", "AsyncStream"]

ASYNC_WORKERS = 256
"""The most acalls of one event-loop iteration running at once (the rest start as they finish), and the most
astreams at once (more wait for a free worker); set before the first call."""

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


class _Item:
    __slots__ = ("token", "fn", "args", "kwargs", "future")

    def __init__(self, token: CancelToken, fn: Callable[..., Any], args: tuple, kwargs: dict, future: asyncio.Future):
        self.token, self.fn, self.args, self.kwargs, self.future = token, fn, args, kwargs, future


class _Tick:
    """The acalls one iteration of an event loop started (``asyncio.gather``; a chain's next awaits, resumed
    together): one lockstep run on a worker (:mod:`.lockstep`, a :class:`~.lockstep.Batch`), so their greedy calls of
    one generator run as one list call and the rest share the engine's steps, as ``run_batch``'s programs do."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.limit, self.next = loop, 0, 0
        self.items: list[_Item] = []
        self.settled: list[tuple[_Item, Any, BaseException | None]] = []

    def next_input(self) -> tuple[int, Any] | None:
        if self.next >= len(self.items):
            return None
        self.next += 1
        return self.next - 1, self.items[self.next - 1]

    def token_of(self, item: _Item) -> CancelToken:
        return item.token  # (each acall is cancelled on its own)

    def new_token(self) -> CancelToken:  # pragma: no cover  (every item has its own)
        raise AssertionError("an acall's instance has its own token")

    def run_one(self, index: int, item: _Item) -> None:
        try:
            result, error = item.fn(*item.args, **item.kwargs), None
        except BaseException as exc:  # noqa: BLE001  (to its own awaiting task)
            result, error = None, exc
        self.settled.append((item, result, error))  # (after the call: round_done swaps the list meanwhile)

    def round_done(self) -> None:
        """Hand the results of a round of instances to the event loop at once: their tasks resume in one iteration,
        so their next acalls form one tick again."""
        settled, self.settled = self.settled, []
        if settled:
            try:
                self.loop.call_soon_threadsafe(_settle, settled)
            except RuntimeError:  # the event loop is closed: nobody is waiting any more
                pass


def _settle(settled: list[tuple[_Item, Any, BaseException | None]]) -> None:
    for item, result, error in settled:
        if item.future.done():  # (cancelled meanwhile)
            continue
        if error is None:
            item.future.set_result(result)
        else:
            item.future.set_exception(error)


_ticks: dict[asyncio.AbstractEventLoop, _Tick] = {}


def _flush(loop: asyncio.AbstractEventLoop, tick: _Tick) -> None:
    if _ticks.get(loop) is tick:
        del _ticks[loop]
    release_team()  # (this thread waits in its event loop while the engine's thread computes: loop/omp.py)
    tick.limit = min(len(tick.items), ASYNC_WORKERS)
    ARRIVALS.expect()  # (the tick's runner is on its way to the engine: it claims the count)
    _pool().submit(_run_tick, tick)


def _run_tick(tick: _Tick) -> None:
    never_drive()
    ARRIVALS.claim()
    try:
        Lockstep(tick).run()
    except BaseException as exc:  # noqa: BLE001  (a bug in the runner: every acall still waiting gets it)
        tick.settled.extend((item, None, exc) for item in tick.items)
    finally:
        ARRIVALS.arrived()
        tick.round_done()


async def to_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``await`` ``fn(*args, **kwargs)`` run off the event loop; cancelling the task cancels the call at its next
    decoding step (the ``CancelledError`` is raised at once, the call leaves right after). The calls started in one
    iteration of the loop run in lockstep together (:class:`_Tick`); without ``greenlet``, each on a worker thread."""
    loop = asyncio.get_running_loop()
    token = CancelToken(parent=current())
    if not AVAILABLE:
        handoff = Handoff()  # (calls gathered together run as one list call where they can: loop/coalesce)
        future = loop.run_in_executor(_pool(), functools.partial(_call, token, handoff, fn, args, kwargs))
    else:
        handoff, future = None, loop.create_future()
        tick = _ticks.get(loop)
        if tick is None:
            tick = _ticks[loop] = _Tick(loop)
            loop.call_soon(_flush, loop, tick)  # (after the tasks already scheduled in this iteration ran)
        tick.items.append(_Item(token, fn, args, kwargs, future))
    try:
        return await future
    except asyncio.CancelledError:
        token.cancel()
        raise
    except Cancelled:  # a parent token was cancelled: a BaseException must not escape into the event loop
        raise asyncio.CancelledError() from None
    finally:
        if handoff is not None:
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
