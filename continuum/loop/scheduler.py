"""Concurrent calls on one model share every forward (continuous batching of decoding loops).

Where things happen::

    generator call (any thread) ──▶ decoding.decode / prefill ──enter()──▶ Ticket (this loop is running)
         each step: model.forward(...) ──▶ Scheduler.forward ──┬─ nobody else running: run it now, alone
                                                               └─ others running: queue the request;
                                                                  the last running loop to arrive runs
                                                                  every queued request in merged forwards
                                                                  (merge.py) and hands out the results
         yield a step to the caller: park() (a parked loop is not waited for) ... resume()
         return / raise / close: leave()

A loop is *running* from ``enter`` to ``leave``, except while parked at a ``yield`` (its consumer
holds the thread: a stream read slowly, or several streams interleaved in one thread, must not
stall the others). A forward request waits until every running loop of another thread has queued
its own request, then the last one to arrive runs them all (no timer, no extra thread: a lone
call takes one uncontended lock and runs its forward itself). A loop joins at its next forward and
leaves when it is done; nobody waits for another call to finish.

Admission: a loop enters only while the rows of running loops stay within ``max_rows`` (a loop
larger than that runs when it is alone); others wait at ``enter``, nothing fails for lack of room.

Errors: if a merged forward raises, each request is run alone so the error reaches only its owner.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import ContinuumError
from ..parallel import world_size
from . import merge
from .merge import Request
from .ranks import Ranks, next_key

__all__ = ["DEFAULT_MAX_ROWS", "Scheduler", "Ticket"]

DEFAULT_MAX_ROWS = 256


class Ticket:
    """One decoding loop's registration with its model's scheduler (see the module docstring)."""

    __slots__ = ("_left", "_sched", "_thread", "rows")

    def __init__(self, sched: Scheduler, rows: int):
        self._sched, self.rows = sched, rows
        self._thread: int | None = None  # the thread running it, None while parked
        self._left = False

    def park(self) -> None:
        """The loop yields to its caller: the others stop waiting for it."""
        if self._thread is not None:
            self._sched._stop(self)

    def resume(self) -> None:
        """The caller resumed the loop (possibly from another thread)."""
        if self._thread is None and not self._left:
            self._sched._start(self, admit=False)

    def leave(self) -> None:
        """The loop is done (returned, raised, or its generator was closed). Idempotent."""
        if not self._left:
            if self._thread is not None:
                self._sched._stop(self, leaving=True)
            self._left = True

    def __enter__(self) -> Ticket:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.leave()


class Scheduler:
    """Merges the forwards of concurrent decoding loops on one model (``model.scheduler``).

    Args:
        model: the ``Transformers`` adapter (runs ``_forward_alone`` and ``_run``).
        max_rows: the most rows of running loops at once (admission bound; default 256).
    """

    def __init__(self, model, max_rows: int = DEFAULT_MAX_ROWS):
        self._model = model
        self.max_rows = max_rows
        self._cond = threading.Condition(threading.Lock())
        self._running: dict[int, int] = {}  # thread id -> running loops on its stack (nested loops count once)
        self._rows = 0  # rows of running loops
        self._pending: list[Request] = []
        self._stats = {"merged_forwards": 0, "requests_merged": 0, "alone": 0, "fallbacks": 0, "new_slabs": 0,
                       "joins_copied": 0, "peak_rows": 0, "peak_padding": 1.0, "peak_kv_bytes": 0}
        self._ranks = Ranks() if world_size(model) > 1 else None  # tensor parallelism: rank 0 decides batches
        self._receiving = False  # a non-leader rank is receiving (then running) rank 0's next batch
        self._gaps: list[float] = []  # seconds between two forwards of one thread, merged steps (bounded sample)
        self._last: dict[int, float] = {}

    # -- registration --------------------------------------------------------------------
    def enter(self, rows: int) -> Ticket:
        """Register a decoding loop of ``rows`` rows, waiting for room (``max_rows``); returns its ticket."""
        ticket = Ticket(self, rows)
        self._start(ticket, admit=True)
        return ticket

    def _start(self, ticket: Ticket, admit: bool) -> None:
        tid = threading.get_ident()
        with self._cond:
            if admit and tid not in self._running and self._ranks is None:  # (admission depends on timing)
                while self._rows and self._rows + ticket.rows > self.max_rows:
                    self._cond.wait()
            self._running[tid] = self._running.get(tid, 0) + 1
            self._rows += ticket.rows
            ticket._thread = tid
            self._cond.notify_all()

    def _stop(self, ticket: Ticket, leaving: bool = False) -> None:
        with self._cond:
            tid = ticket._thread
            if leaving:  # the next forward of this thread is another call's: no step wait to measure
                self._last.pop(tid, None)  # type: ignore[arg-type]
            ticket._thread = None
            left = self._running.get(tid, 0) - 1  # type: ignore[arg-type]
            if left > 0:
                self._running[tid] = left  # type: ignore[index]
            else:
                self._running.pop(tid, None)  # type: ignore[arg-type]
            self._rows -= ticket.rows
            self._cond.notify_all()

    @contextmanager
    def idle(self) -> Iterator[None]:
        """This thread waits for another call (e.g. for its prefill of a shared prefix): not waited for meanwhile."""
        tid = threading.get_ident()
        with self._cond:
            depth = self._running.pop(tid, 0)
            self._cond.notify_all()
        try:
            yield
        finally:
            if depth:
                with self._cond:
                    self._running[tid] = self._running.get(tid, 0) + depth
                    self._cond.notify_all()

    def _ready(self) -> bool:
        """Every running thread has a request queued."""
        queued = {r.thread for r in self._pending}
        return all(t in queued for t in self._running)

    # -- forwards ------------------------------------------------------------------------
    @property
    def coordinated(self) -> bool:
        """Under tensor parallelism: every forward is decided on rank 0 (:mod:`continuum.loop.ranks`)."""
        return self._ranks is not None

    def forward(self, ids, mask, pos, kv, logits: str, reserve: int, allowed=None):
        """``model.forward`` under the scheduler: alone when no other loop runs, else merged (a token-tree
        request, ``allowed`` given, runs alone in the runner's batch)."""
        if self._ranks is not None:
            return self._forward_coordinated(Request(ids, mask, pos, kv, logits, reserve, threading.get_ident(),
                                                     allowed=allowed))
        tid = threading.get_ident()
        with self._cond:
            alone = not self._pending and all(t == tid for t in self._running)
            if not alone:
                req = Request(ids, mask, pos, kv, logits, reserve, tid, allowed=allowed)
                temporary = tid not in self._running  # a forward outside any loop (scoring, a user's own call)
                if temporary:
                    self._running[tid] = 1
                self._pending.append(req)
                self._cond.notify_all()
        if alone:
            return self._model._forward_alone(ids, mask, pos, kv, logits=logits, reserve=reserve, allowed=allowed)
        try:
            batch = self._wait(req)
        finally:
            if temporary:
                with self._cond:
                    self._running.pop(tid, None)
                    self._cond.notify_all()
        if batch is not None:
            self._run(batch)
        if req.error is not None:
            raise req.error
        return req.result

    def _forward_coordinated(self, req: Request):
        """:meth:`forward` under tensor parallelism: rank 0 composes every batch and broadcasts its keys;
        the other ranks run exactly those requests, in that order (see :mod:`continuum.loop.ranks`)."""
        assert self._ranks is not None
        req.key = next_key()
        tid = req.thread
        with self._cond:
            if any(r.key == req.key for r in self._pending):
                raise ContinuumError(f"two concurrent calls have the same call key {req.key[0]!r}: give each program "
                                     f"instance its own continuum.loop.ranks.call_key")
            temporary = tid not in self._running
            if temporary:
                self._running[tid] = 1
            self._pending.append(req)
            self._cond.notify_all()
        try:
            while not req.done:
                self._coordinated_round(req)
        finally:
            if temporary:
                with self._cond:
                    self._running.pop(tid, None)
                    self._cond.notify_all()
        if req.error is not None:
            raise req.error
        return req.result

    def _coordinated_round(self, req: Request) -> None:
        """Wait until ``req`` is done, or run one batch: rank 0 composes and sends it, other ranks receive it."""
        assert self._ranks is not None
        batch: list[Request] | None = None
        follower = False
        with self._cond:
            while not req.done and batch is None and not follower:
                if self._ranks.leader and self._ready() and req in self._pending:
                    batch, self._pending = sorted(self._pending, key=lambda r: repr(r.key)), []
                elif not self._ranks.leader and not self._receiving and req in self._pending:
                    self._receiving = follower = True
                else:
                    self._cond.wait()
        if batch is not None:
            self._ranks.share([r.key for r in batch])
            self._run(batch)
            return
        if not follower:
            return
        try:  # receive rank 0's batch, wait until all its requests are queued here, run exactly them
            keys = self._ranks.share([])
            wanted = set(keys)
            with self._cond:
                while not wanted.issubset(r.key for r in self._pending):
                    self._cond.wait()
                by_key = {r.key: r for r in self._pending}
                batch = [by_key[k] for k in keys]
                self._pending = [r for r in self._pending if r.key not in wanted]
            self._run(batch)
        finally:
            with self._cond:
                self._receiving = False
                self._cond.notify_all()

    def _wait(self, req: Request) -> list[Request] | None:
        """Wait until ``req`` was run by another thread (None), or until this thread should run the batch."""
        with self._cond:
            try:
                while not req.done:
                    if self._ready() and req in self._pending:
                        batch, self._pending = self._pending, []
                        return batch
                    self._cond.wait()
            except BaseException:  # e.g. KeyboardInterrupt while waiting: withdraw the request
                if req in self._pending:
                    self._pending.remove(req)
                self._cond.notify_all()
                raise
        return None

    def _run(self, batch: list[Request]) -> None:
        """Run ``batch`` (this thread is the runner), then wake every owner."""
        try:
            self._run_groups(batch)
        except BaseException:  # the runner itself was interrupted: the others' requests go back in the queue
            with self._cond:
                self._pending[:0] = [r for r in batch if not r.done and r.thread != threading.get_ident()]
                self._cond.notify_all()
            raise
        with self._cond:
            now = time.perf_counter()
            for r in batch:
                r.done = True
                last = self._last.get(r.thread)
                if last is not None and len(self._gaps) < 100_000:
                    self._gaps.append(now - last)
                self._last[r.thread] = now
            if len(self._last) > 10_000:  # thread ids of finished threads
                self._last.clear()
            self._cond.notify_all()

    def _run_groups(self, batch: list[Request]) -> None:
        model = self._model
        alone = [r for r in batch if not r.mergeable]
        merged = [r for r in batch if r.mergeable]
        for group in merge.groups(merged):
            if len(group) == 1 and merge.slot_of(group[0].kv) is None:
                alone.append(group[0])
                continue
            try:
                p = merge.plan(group, len(group[0].kv) if group[0].kv is not None else model._layers)
                self._note(p)
                results = merge.run_group(model, p)
            except Exception:  # noqa: BLE001  (the merged forward failed: run each alone, so an error reaches only its owner)
                self._stats["fallbacks"] += 1
                alone.extend(group)
                continue
            for r, res in zip(group, results):
                r.result = res
            self._stats["peak_kv_bytes"] = max(self._stats["peak_kv_bytes"], p.slab.nbytes())
            with model._count_lock:
                model.tokens_computed += sum(r.ids.numel() for r in group)
            self._stats["merged_forwards"] += 1
            self._stats["requests_merged"] += len(group)
        for r in alone:
            self._stats["alone"] += 1
            try:
                r.result = model._forward_alone(r.ids, r.mask, r.pos, r.kv, logits=r.logits, reserve=r.reserve,
                                                allowed=r.allowed)
            except Exception as exc:  # noqa: BLE001  (handed to the request's owner, raised there)
                r.error = exc

    def _note(self, p: merge.Plan) -> None:
        """Statistics of a planned merged forward: rows, padding (cells / real tokens), KV bytes."""
        s = self._stats
        s["new_slabs"] += p.fresh
        s["joins_copied"] += sum(kv is not None for kv, _, _ in p.copies) if not p.fresh else 0
        real = sum(int(r.mask.sum()) for r in p.requests)
        cells = p.forward_rows * (p.cached + p.new)
        s["peak_rows"] = max(s["peak_rows"], p.forward_rows)
        if cells >= s.get("_peak_cells", 0):
            s["_peak_cells"] = cells
            s["peak_padding"] = cells / max(real, 1)

    # -- reporting -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters of merged forwards, and at the largest merged step: ``peak_padding`` (KV cells of the
        merged cache, holes and dead rows included, over real tokens); ``peak_kv_bytes``: the largest
        slab's storage (spare rows and columns reserved ahead included); ``p99_step_wait_s``: the 99th
        percentile of the time between two forwards of one thread while calls were merged."""
        with self._cond:
            out = {k: v for k, v in self._stats.items() if not k.startswith("_")}
            gaps = sorted(self._gaps)
        out["p99_step_wait_s"] = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0
        out["max_rows"] = self.max_rows
        return out

    def reset_stats(self) -> None:
        with self._cond:
            for k in self._stats:
                self._stats[k] = 1.0 if k == "peak_padding" else 0
            self._gaps.clear()
            self._last.clear()
