"""One engine per model: it owns the decode loop of every running call (``model.engine``).

Where things happen::

    generator call (any thread) ──▶ decoding.decode: checks, prefix reuse, Rows (the caller's thread)
         │  the loop (a Python generator) yields its first forward request
         ▼
    Engine.submit ──▶ inbox ──(next step boundary)──▶ running calls ──▶ Engine._step, once for all of them:
                                                        1. admit: new calls join (within max_rows,
                                                           max_kv_bytes; arrivals.py: setups waited for)
                                                        2. ONE merged forward per group (merge.py), every
                                                           call's request, log-softmax over the whole group;
                                                           no room in a fixed pool: park the newest (room.py)
                                                        3. each call's loop resumes with its result and
                                                           runs to its next forward request (or ends)
    the caller waits on ONE event (a stream reads a queue) ◀── its call ended: result or error

Who drives (runs the steps): a lone non-streaming call drives inline, in its own thread (it costs
what a call always cost: no thread hop). Calls that arrive meanwhile join its next step. When the
driver's own call ends and others remain, the engine's thread (one daemon per model, started on
first use) takes over; it sleeps on a condition while no call runs (no polling, no CPU when idle).
A waiting caller is woken once, when its call is done; a stream's consumer once per chunk.

A call is a *coroutine*: ``decoding._decode`` yields a :class:`~continuum.models.request.Request` where
it needs the model and a ``Step`` after each step (handed to its stream, if any). Everything a call
does between two forwards (guides, sampler, stop strings, fast-forward, beam reorders) is its own
code, unchanged; only the forward and its log-softmax are shared. Forwards a call makes outside its
loop (a prefill for ``max_tokens=0``, choice scoring's token tree, classifier-free guidance's first
prefill) are *one-off requests*: merged into the next step when the engine runs, run at once when it
is idle (or when the driver itself makes them, inside a step).

Errors: a merged forward that raises is re-run per request (the error reaches only its owner); a call
whose loop raises ends with that error, the others go on. Cancellation (Ctrl-C, a cancelled task, a
closed stream) is checked by each call's loop at every step. Under torchrun rank 0 decides which calls
join at each step (``Ranks.admit``), so every rank runs the same steps.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Generator
from typing import Any

import torch

from ..errors import ContinuumError
from ..models.request import Request
from . import cancel
from .arrivals import ARRIVALS, GATE
from .call import END, Call
from .checks import engine_setting
from .forwards import new_counters, report
from .parallel import world_size
from .ranks import Ranks, next_key
from .room import Room

__all__ = ["DEFAULT_MAX_ROWS", "Engine", "Call", "END"]

DEFAULT_MAX_ROWS = 256
DEFAULT_PREFILL_CHUNK = 512  # columns of a long prefill per step while other calls run (see Engine.prefill_chunk)


_ENGINES: weakref.WeakSet = weakref.WeakSet()  # engines whose thread was started (stopped at interpreter exit)


def _stop_all() -> None:
    for engine in list(_ENGINES):
        engine._stop()


class Engine:
    """The decode loop of every running call on one model (see the module docstring).

    Args:
        model: the ``Transformers`` adapter (runs ``forward_now`` and ``_run``).
        max_rows: the most rows of running calls at once (admission bound; default 256). A call larger
            than that runs when it is alone; others wait in the inbox, nothing fails for lack of room.
        max_kv_bytes: the most KV bytes the running calls may reach, each at its longest (input plus
            ``max_tokens``, or the context), or None (default); admission as for ``max_rows``.
        prefill_chunk: a call arriving while others run prefills a longer uncached suffix this many columns
            per step (default 512; None: never), so their next tokens do not wait for a whole long prompt.
        Each is checked when set (a positive int; a continuum error otherwise).
    """

    max_rows = engine_setting("max_rows", allow_none=False)
    max_kv_bytes = engine_setting("max_kv_bytes", allow_none=True)
    prefill_chunk = engine_setting("prefill_chunk", allow_none=True)

    def __init__(self, model, max_rows: int = DEFAULT_MAX_ROWS, max_kv_bytes: int | None = None,
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK):
        self._model = model
        self.max_rows, self.max_kv_bytes = max_rows, max_kv_bytes
        self.prefill_chunk = prefill_chunk
        self._cond = threading.Condition(threading.Lock())
        self._inbox: list[Call | Request] = []
        self._running: list[Call] = []
        self._rows = self._kv = 0  # the running calls' rows and KV bytes (at their longest)
        self._driver: int | None = None  # the thread running steps
        self._thread: threading.Thread | None = None
        self._closing = False
        self._ended: list[Call] = []  # calls done in this step, woken when it ends
        self.arrivals = ARRIVALS  # calls on their way (set up in their callers' threads): the next step waits for them
        self._step_s = 0.0  # the last step's duration: how long the next step may wait for them
        self._ranks = Ranks() if world_size(model) > 1 else None  # tensor parallelism: rank 0 decides
        self._room = Room()  # parked calls: the pool had no room for them (room.py)
        self._stats: dict[str, Any] = {}
        self._steps: list[float] = []  # seconds per step while several calls ran (bounded sample)
        self.reset_stats()

    def chunk_for(self, width: int) -> int | None:
        """Columns per step for a prefill of ``width`` new columns set up now: ``prefill_chunk`` while other calls
        run (not under torchrun, where ranks see different instants), else None (one forward)."""
        chunk = self.prefill_chunk
        if not chunk or width <= chunk or self._ranks is not None or not self._running:
            return None
        return chunk

    @property
    def coordinated(self) -> bool:
        """Under tensor parallelism: every step's composition is decided on rank 0 (:mod:`continuum.loop.ranks`)."""
        return self._ranks is not None

    # -- calls ---------------------------------------------------------------------------
    def submit(self, gen: Generator, first: Request, rows: int, stream: bool = False, kv_bytes: int = 0) -> Call:
        """Hand a decoding loop (suspended at its first forward request ``first``) to the engine; ``kv_bytes``:
        the KV it may reach (for ``max_kv_bytes``)."""
        key = next_key() if self._ranks is not None else None
        call = Call(gen, first, rows, stream, key, kv_bytes)
        with self._cond:
            self._inbox.append(call)  # (a driver admits it at its next step, or the caller drives in wait())
            if self._ranks is not None:
                self._cond.notify_all()  # a rank waiting for rank 0's admissions looks again
        self.arrivals.arrived()  # (in the inbox: a step waiting for its setup may run now)
        if stream:
            self._wake()  # streams are driven by the engine's thread
        return call

    def wait(self, call: Call) -> Any:
        """The call's final state: drive the engine inline when nobody does, else sleep until it is done."""
        me = threading.get_ident()
        with self._cond:
            drive = self._driver is None and not call.done
            if drive:
                self._driver = me
        try:
            with GATE.waiting():
                self._until_done(call, drive)
        except BaseException:  # Ctrl-C in the caller's thread: the loop leaves at the next step
            self.close(call)
            raise
        finally:
            self.arrivals.resumed()  # (a run_batch program goes on to its next call)
        if call.error is not None:
            raise call.error
        return call.result

    def close(self, call: Call) -> None:
        """The caller is gone (a closed stream, an interrupt): the loop is closed at the next step;
        returns once it has left (at once when called by the driver itself)."""
        if not call.done:
            call.closed = True
            self._wake()
            if self._driver != threading.get_ident():
                call.event.wait()

    def stream(self, call: Call):
        """The call's steps as they come (the consumer is woken per step), then its final state."""
        assert call.queue is not None
        while True:
            item = call.queue.get()
            if item is END:
                break
            yield item
        if call.error is not None:
            raise call.error
        return call.result

    # -- one-off forwards --------------------------------------------------------------------
    def forward(self, ids, mask, pos, kv, logits: str, reserve: int, allowed=None):
        """``model.forward`` outside a running loop's step: merged into the engine's next step (this thread
        runs that step when nobody else drives: a lone one costs one forward); at once when the driver
        itself makes it, inside a step."""
        me = threading.get_ident()
        self.arrivals.arrived()  # (a call's setup making a one-off request: the step must not wait for it)
        with self._cond:
            alone = self._driver == me
            if not alone:
                req = Request(ids, mask, pos, kv, logits, reserve, me, allowed=allowed)
                req.key = next_key() if self._ranks is not None else None
                req.event = threading.Event()
                self._inbox.append(req)
                drive = self._driver is None
                if drive:
                    self._driver = me
                elif self._ranks is not None:
                    self._cond.notify_all()  # a rank waiting for rank 0's admissions looks again
        if alone:
            return self._model.forward_now(ids, mask, pos, kv, logits=logits, reserve=reserve, allowed=allowed)
        try:
            with GATE.waiting():
                self._until_done(req, drive)
        finally:
            self.arrivals.resumed()
        if req.error is not None:
            raise req.error
        return req.result

    # -- driving -------------------------------------------------------------------------
    def _until_done(self, item: Call | Request, drive: bool) -> None:
        """Run steps until ``item`` is done (this thread drives), or sleep on its event until it is."""
        if not drive:
            item.event.wait()
            return
        try:
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
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                if not _ENGINES:
                    atexit.register(_stop_all)
                _ENGINES.add(self)
                self._thread = threading.Thread(target=self._serve, name="continuum-engine", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _serve(self) -> None:
        """The engine's thread: drive while calls run and nobody else drives; sleep otherwise."""
        me = threading.get_ident()
        while True:
            with self._cond:
                while not (self._has_work() and self._driver is None):
                    if self._closing:
                        return
                    self._cond.wait()
                self._driver = me
            try:
                while True:
                    self._step()
                    with self._cond:
                        if not self._has_work():
                            break
            except BaseException as exc:  # noqa: BLE001  (a bug in the engine itself: fail every call, keep serving)
                self._fail_all(exc)
            finally:
                with self._cond:
                    self._driver = None
                    self._cond.notify_all()

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            calls, self._running = self._running, []
            pending, self._inbox = self._inbox, []
            self._rows = self._kv = 0
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

    # -- one step ------------------------------------------------------------------------
    def _admit(self) -> tuple[list[Call], list[Request]]:
        """Take the inbox's calls that fit (``max_rows``, ``max_kv_bytes``) and every one-off request."""
        chosen: list[Call | Request] = []
        rest: list[Call | Request] = []
        with self._cond:
            if self._ranks is not None:
                chosen = self._ranks.admit(self._cond, self._inbox)
            else:
                rows, kv, budget = self._rows, self._kv, self.max_kv_bytes
                wait = any(c.parked for c in self._running)  # parked calls are older: new ones wait behind them
                for item in self._inbox:
                    if isinstance(item, Call):
                        wait = wait or bool(rows and (rows + item.rows > self.max_rows or
                                                      (budget is not None and kv + item.kv > budget)))
                        if wait:  # (in arrival order: a call that waits keeps the later ones waiting; alone, it runs)
                            rest.append(item)
                            continue
                        rows, kv = rows + item.rows, kv + item.kv
                    chosen.append(item)
                self._inbox = rest
            calls = [c for c in chosen if isinstance(c, Call)]
            self._room.number(calls)
            self._running.extend(calls)
            self._rows += sum(c.rows for c in calls)
            self._kv += sum(c.kv for c in calls)
            self._stats["peak_running_kv_bytes"] = max(self._stats["peak_running_kv_bytes"], self._kv)
        return calls, [r for r in chosen if isinstance(r, Request)]

    @torch.inference_mode()  # (the loops' tensors and the merged forwards: no autograd, as in model.forward)
    def _step(self) -> None:
        """One step of every running call: admit, one merged forward, every loop to its next request."""
        # calls being set up join this step, not a later one (under torchrun rank 0 decides the admissions: no wait)
        self.arrivals.gather(self._step_s if self._ranks is None else 0.0)
        t0 = time.perf_counter()
        with self._cond:
            self._stats["resumed"] += len(self._room.back(self._running))  # parked calls whose turn has come
        _, oneoff = self._admit()
        try:
            running = list(self._running)
            closed = [c for c in running if c.closed]
            for c in closed:
                c.gen.close()
                self._end(c, None, None)
            live = [c for c in running if not c.closed and not c.parked]
            live = self._room.run(live, oneoff, self._run_requests, self._model.hold, self._stats)
        except BaseException as exc:  # (the one-off requests left the inbox: _fail_all cannot see them)
            self._fail_oneoff(oneoff, exc)
            raise
        for r in oneoff:
            r.done = True
            r.event.set()
        try:
            for c in live:
                self._resume(c)
        finally:
            ended, self._ended = self._ended, []
            for c in ended:
                self._wake_caller(c)
        took = time.perf_counter() - t0
        if len(live) > 1 and len(self._steps) < 100_000:
            self._steps.append(took)
        self._stats["steps"] += 1
        self._stats["busy_s"] += took
        self._step_s = took

    def _resume(self, call: Call) -> None:
        """Run ``call``'s loop from its forward's result to its next forward request, or to its end."""
        req, saved = call.pending, cancel.current()
        cancel._local.token = call.token  # the call's own cancellation and progress count, as in its thread
        try:
            item = call.gen.throw(req.error) if req.error is not None else call.gen.send(None)
            while not isinstance(item, Request):  # a Step: to the stream, if any
                if call.queue is not None:
                    call.queue.put(item)
                item = call.gen.send(None)
            call.pending = item
        except StopIteration as stop:
            self._end(call, stop.value, None, wake=False)
        except BaseException as exc:  # noqa: BLE001  (the call's own error, Cancelled included: to its caller)
            self._end(call, None, exc, wake=False)
        finally:
            cancel._local.token = saved

    def _end(self, call: Call, result: Any, error: BaseException | None, wake: bool = True) -> None:
        """``call`` is done; its caller is woken now, or (``wake=False``, inside a step) when the step ends, so
        that callers taking up their results do not compete with the rest of the step for the GIL."""
        with self._cond:
            if call in self._running:
                self._room.ended += 1  # (its cells are free: a parked call may come back)
                self._running.remove(call)
                self._rows -= call.rows
                self._kv -= call.kv
            call.result, call.error, call.done = result, error, True
        if wake:
            self._wake_caller(call)
        else:
            self._ended.append(call)

    def _wake_caller(self, call: Call) -> None:
        if call.queue is not None:
            call.queue.put(END)
        call.event.set()  # the one wake-up of its caller
        self._stats["wakeups"] += 1

    def _run_requests(self, batch: list[Request]) -> None:
        self._model.run_step(batch, self._stats)  # the backend's own way (models/protocol.py)

    # -- reporting -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters: ``steps``, ``busy_s`` (time in steps), ``forward_s`` (in the model's forwards: the
        merged forwards' log-softmax included), ``outside_forward_share`` (the engine's own share of a step),
        ``merged_forwards``, ``requests_merged``, ``alone``, ``fallbacks``,
        ``wakeups`` (callers woken: one per call); at the largest merged step ``peak_rows`` and
        ``peak_padding`` (KV cells of the merged cache, holes and dead rows included, over real tokens);
        ``peak_kv_bytes``: the largest slab's storage; ``p99_step_s``: the 99th percentile of a step's
        time while several calls ran (the wait between two tokens of one call)."""
        with self._cond:
            out = report(self._stats, self._steps)
            out["running_calls"], out["running_rows"], out["running_kv_bytes"] = len(self._running), self._rows, self._kv
            out["parked_calls"] = sum(c.parked for c in self._running)
            out["waiting_calls"] = sum(isinstance(c, Call) for c in self._inbox)
        out["max_rows"], out["max_kv_bytes"] = self.max_rows, self.max_kv_bytes
        return out

    @property
    def running_hint(self) -> int:
        """Calls in the engine's steps now, read without the lock (a loop running inside a step may ask; the count
        may be one step old): speculation drafts only while few calls share a step."""
        return len(self._running)

    def decoding_calls(self) -> int:
        """Calls taking part in the steps now (running, not parked): cheap, unlike :meth:`stats`, for a server's
        per-request queue check."""
        with self._cond:
            return sum(not c.parked for c in self._running)

    def reset_stats(self) -> None:
        with self._cond:
            self._stats = new_counters()
            self._steps.clear()
