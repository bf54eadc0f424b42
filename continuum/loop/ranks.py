"""The same merged batches on every rank of a torchrun launch (tensor parallelism).

Threads do not reach the model at the same instants in every process, so which requests share a
forward would differ between ranks, and ranks running different forwards abort on mismatched
collectives, or hang. Under tensor parallelism the scheduler therefore runs *coordinated*: every
forward request carries a key that names it identically on every rank, ``(call key, ordinal)``:
the call key of the program instance that made it (:func:`call_key`, which ``run_batch`` sets for
every instance; the main thread's is ``"main"``) and the number of forwards that instance made
before. Rank 0 decides each merged batch (every running loop has queued a request) and broadcasts
its keys; the other ranks run exactly those requests, in that order, as soon as they are all queued.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

from ..errors import ContinuumError

__all__ = ["Ranks", "call_key", "current_key", "next_key"]

_local = threading.local()


@contextmanager
def call_key(key: Hashable) -> Iterator[None]:
    """Name the calls this thread makes inside the block (the same key on every rank: e.g. the index
    of a program instance). Needed for concurrent calls under tensor parallelism; harmless elsewhere."""
    saved = getattr(_local, "key", None), getattr(_local, "count", 0)
    _local.key, _local.count = key, 0
    try:
        yield
    finally:
        _local.key, _local.count = saved


def current_key() -> Hashable | None:
    """The call key this thread set with :func:`call_key` (None outside one)."""
    return getattr(_local, "key", None)


def next_key() -> tuple:
    """The key of this thread's next forward request."""
    key = getattr(_local, "key", None)
    if key is None:
        if threading.current_thread() is not threading.main_thread():
            raise ContinuumError(
                "under tensor parallelism (torchrun), concurrent calls from several threads must be named the same way "
                "on every rank: run them with continuum.run_batch, or wrap each thread's program in "
                "`with continuum.loop.ranks.call_key(i):` with i the same on every rank (e.g. the input's index)")
        key = "main"
    count = getattr(_local, "count", 0)
    _local.count = count + 1
    return (key, count)


class Ranks:
    """Broadcast of merged-batch compositions from rank 0 (``torch.distributed``'s default group)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.leader = dist.get_rank() == 0

    def share(self, keys: list[tuple]) -> list[tuple]:
        """Rank 0: send ``keys``; other ranks: receive rank 0's (``keys`` ignored)."""
        box = [keys if self.leader else None]
        self._dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def admit(self, cond: threading.Condition, inbox: list) -> list:
        """One step's admissions (``cond`` held; ``inbox``: items with a ``key``, taken out in place, as other
        threads append to it while the lock is released): rank 0 admits its whole inbox and broadcasts the
        keys; the other ranks wait until those are in their inbox and admit exactly them, in that order."""
        if self.leader:
            chosen = sorted(inbox, key=lambda x: repr(x.key))
            inbox.clear()
            cond.release()
            try:
                self.share([x.key for x in chosen])
            finally:
                cond.acquire()
            return chosen
        cond.release()
        try:
            keys = self.share([])
        finally:
            cond.acquire()
        wanted = set(keys)
        while not wanted.issubset(x.key for x in inbox):
            cond.wait()
        by_key = {x.key: x for x in inbox}
        inbox[:] = [x for x in inbox if x.key not in wanted]
        return [by_key[k] for k in keys]
