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

Who drives (runs the steps): a lone non-streaming call drives inline, in its own thread (no thread hop);
calls that arrive meanwhile join its next step. When the driver's own call ends and others remain, the
engine's thread (one daemon per model) takes over; it sleeps on a condition while no call runs. While
``run_batch``'s caller hosts (host.py), it drives instead, for its workers' calls. A waiting caller is
woken once, when its call is done; a stream's consumer once per chunk.

A call is a *coroutine*: ``decoding._decode`` yields a :class:`~continuum.models.request.Request` where
it needs the model and a ``Step`` after each step (handed to its stream, if any). Everything a call
does between two forwards (guides, sampler, stop strings, fast-forward, beam reorders) is its own
code; only the forward and its log-softmax are shared. Forwards a call makes outside its loop (a
prefill for ``max_tokens=0``, choice scoring's token tree, CFG's first prefill) are *one-off requests*:
merged into the next step when the engine runs, run at once when it is idle (or by the driver itself).

Errors: a merged forward that raises is re-run per request (the error reaches only its owner); a call
whose loop raises ends with that error, the others go on. Cancellation (Ctrl-C, a cancelled task, a
closed stream) is checked by each call's loop at every step. Under torchrun rank 0 decides which calls
join at each step (``Ranks.admit``), so every rank runs the same steps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from typing import Any

import torch

from ..models.request import Request
from . import cancel, room
from .arrivals import ARRIVALS, GATE
from .call import END, Call
from .checks import checked_setting, engine_setting
from .driving import Driving
from .forwards import new_counters, report
from .parallel import world_size
from .ranks import Ranks, next_key
from .scheduler import DEFAULT_MAX_ROWS, Plan, Scheduler

__all__ = ["DEFAULT_MAX_ROWS", "Engine", "Call", "END"]

DEFAULT_PREFILL_CHUNK = 512  # columns of a long prefill per step while other calls run (see Engine.prefill_chunk)


class Engine(Driving):
    """The decode loop of every running call on one model (see the module docstring).

    Args:
        model: the backend (``models/protocol.py``): it runs a step's requests (``run_step``), says its capacity.
        max_rows: the most rows of running calls at once (admission bound; default 256, or the backend's
            ``default_max_rows``: 32 on llama.cpp). A call larger
            than that runs when it is alone; others wait in the inbox, nothing fails for lack of room.
        max_kv_bytes: the most KV bytes the running calls may reach, each at its longest (input plus
            ``max_tokens``, or the context), or None (default); admission as for ``max_rows``.
        prefill_chunk: a call arriving while others run prefills a longer uncached suffix this many columns
            per step (default 512; None: never), so their next tokens do not wait for a whole long prompt.
        Each is checked when set (a positive int; a continuum error otherwise).
    """

    prefill_chunk = engine_setting("prefill_chunk", allow_none=True)

    def __init__(self, model, max_rows: int | None = None, max_kv_bytes: int | None = None,
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK):
        self._model = model
        self.scheduler = Scheduler(model)  # the decision: what runs, parks, resumes, waits (scheduler.py)
        # (a backend may say how many rows a step runs best with: llama.cpp's unified pool on a CPU, 32)
        self.max_rows = max_rows if max_rows is not None else getattr(model, "default_max_rows", DEFAULT_MAX_ROWS)
        if max_kv_bytes is not None:
            self.max_kv_bytes = max_kv_bytes
        self.prefill_chunk = prefill_chunk
        self._cond = threading.Condition(threading.Lock())
        self._inbox: list[Call | Request] = []
        self._running: list[Call] = []
        self._driver: int | None = None  # the thread running steps
        self._thread: threading.Thread | None = None
        self._closing = False
        self._ended: list[Call] = []  # calls done in this step, woken when it ends
        self._interrupted = False  # Ctrl-C landed in a call's code while this thread drove the step (_resume)
        self.arrivals = ARRIVALS  # calls on their way (set up in their callers' threads): the next step waits for them
        self._step_s = 0.0  # the last step's duration: how long the next step may wait for them
        self._ranks = Ranks() if world_size(model) > 1 else None  # tensor parallelism: rank 0 decides
        self._stats: dict[str, Any] = {}
        self._steps: list[float] = []  # seconds per step while several calls ran (bounded sample)
        self.reset_stats()

    @property
    def max_rows(self) -> int:
        """The most rows of running calls at once (see :class:`Engine`; checked when set)."""
        return self.scheduler.max_rows

    @max_rows.setter
    def max_rows(self, value: int) -> None:
        self.scheduler.max_rows = checked_setting("max_rows", value, allow_none=False)

    @property
    def max_kv_bytes(self) -> int | None:
        """The running calls' KV bytes bound: the model's ``kv_budget`` (one source of truth; checked when set)."""
        return self.scheduler.kv_budget

    @max_kv_bytes.setter
    def max_kv_bytes(self, value: int | None) -> None:
        self._model.kv_budget = checked_setting("max_kv_bytes", value, allow_none=True)

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
    def submit(self, gen: Generator, first: Request, rows: int, stream: bool = False, kv_bytes: int = 0,
               grow: int | None = None) -> Call:
        """Hand a decoding loop (suspended at its first forward request ``first``) to the engine; ``kv_bytes``:
        the KV it may reach (for ``max_kv_bytes``); ``grow``: the most positions its rows may add (None: unbounded)."""
        key = next_key() if self._ranks is not None else None
        call = Call(gen, first, rows, stream, key, kv_bytes, grow)
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
        hop = self._hop()
        with self._cond:
            drive = self._driver is None and not call.done and not hop
            if drive:
                self._driver = me
                self._cond.notify_all()  # (an idle engine thread frees its OpenMP team while this one computes)
        if hop:
            self._wake()
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
            with self._cond:
                waiting = call in self._inbox
                if waiting:  # (never admitted: it leaves now, its place in the queue freed, no step waited for)
                    self._inbox.remove(call)
            if waiting:
                call.gen.close()
                self._end(call, None, None)
                return
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
    def forward(self, ids, mask, pos, kv, logits: str, reserve: int, allowed=None, outputs=None):
        """``model.forward`` outside a running loop's step: merged into the engine's next step (this thread
        runs that step when nobody else drives: a lone one costs one forward); at once when the driver
        itself makes it, inside a step."""
        me = threading.get_ident()
        self.arrivals.arrived()  # (a call's setup making a one-off request: the step must not wait for it)
        hop = self._hop()
        with self._cond:
            alone = self._driver == me
            if not alone:
                req = Request(ids, mask, pos, kv, logits, reserve, allowed=allowed, outputs=outputs)
                req.key = next_key() if self._ranks is not None else None
                req.event = threading.Event()
                self._inbox.append(req)
                drive = self._driver is None and not hop
                if drive:
                    self._driver = me
                    self._cond.notify_all()  # (as in wait: an idle engine thread frees its team)
                elif self._ranks is not None:
                    self._cond.notify_all()  # a rank waiting for rank 0's admissions looks again
        if alone:
            return self._model.forward_now(ids, mask, pos, kv, logits=logits, reserve=reserve, allowed=allowed,
                                           outputs=outputs)
        if hop:
            self._wake()
        try:
            with GATE.waiting():
                self._until_done(req, drive)
        finally:
            self.arrivals.resumed()
        if req.error is not None:
            raise req.error
        return req.result

    # -- one step ------------------------------------------------------------------------
    def _schedule(self) -> list[Request]:
        """The scheduler's plan for this step, applied: calls admitted, parked, resumed; the one-offs to run now."""
        with self._cond:
            if self._ranks is not None:  # (rank 0 decides the admissions; every rank runs them)
                chosen = self._ranks.admit(self._cond, self._inbox)
                plan = Plan(admit=[c for c in chosen if isinstance(c, Call)],
                            oneoff=[r for r in chosen if isinstance(r, Request)])
            else:
                plan = self.scheduler.plan(self._running, self._inbox)
            self._inbox = self.scheduler.apply(plan, self._running, self._inbox, self._stats)
        return plan.oneoff

    @torch.inference_mode()  # (the loops' tensors and the merged forwards: no autograd, as in model.forward)
    def _step(self) -> None:
        """One step of every running call: admit, one merged forward, every loop to its next request."""
        # calls being set up join this step, not a later one (under torchrun rank 0 decides the admissions: no wait)
        self.arrivals.gather(self._step_s if self._ranks is None else 0.0)
        t0 = time.perf_counter()
        for c in [c for c in self._running if c.closed]:  # (before the plan: their room is free for it)
            c.gen.close()
            self._end(c, None, None)
        oneoff = self._schedule()
        try:
            live = [c for c in self._running if not c.parked]
            live, later = room.execute(self._model, self.scheduler, self._stats, live, oneoff)
            if later:  # (one-offs that found no room beside the others: first in the next step)
                with self._cond:
                    self._inbox[:0] = later
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
        if self._interrupted:
            self._interrupted = False
            raise KeyboardInterrupt
        took = time.perf_counter() - t0
        if len(live) > 1 and len(self._steps) < 100_000:
            self._steps.append(took)
        self._stats["steps"] += 1
        self._stats["busy_s"] += took
        self._step_s = took

    def _resume(self, call: Call) -> None:
        """Run ``call``'s loop from its forward's result to its next forward request, or to its end."""
        req, saved = call.pending, cancel.current()
        call.steps += 1
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
        except KeyboardInterrupt:  # (Ctrl-C in the thread driving this step: not this call's error. It ends
            self._end(call, None, cancel.Cancelled(), wake=False)  # cancelled; the step raises it once the others
            self._interrupted = True  # are resumed, so run_batch's caller stops the run instead of losing it)
        except BaseException as exc:  # noqa: BLE001  (the call's own error, Cancelled included: to its caller)
            self._end(call, None, exc, wake=False)
        finally:
            cancel._local.token = saved

    def _end(self, call: Call, result: Any, error: BaseException | None, wake: bool = True) -> None:
        """``call`` is done; its caller is woken now, or (``wake=False``, inside a step) when the step ends, so
        that callers taking up their results do not compete with the rest of the step for the GIL."""
        with self._cond:
            if call in self._running:
                self._running.remove(call)
                self.scheduler.ended(call)
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

    # -- reporting -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters: ``steps``, ``busy_s`` (time in steps), ``forward_s`` (in the model's forwards, the merged ones'
        log-softmax included), ``outside_forward_share``, ``merged_forwards``, ``requests_merged``, ``alone``,
        ``fallbacks``, ``wakeups`` (callers woken: one per call); ``peak_rows`` (the most rows one step ran); on
        transformers, at the largest merged step, ``peak_padding`` (KV cells, holes and dead rows included, over real
        tokens) and ``peak_kv_bytes`` (the largest slab; llama.cpp has no slabs: 1.0 and 0); ``p99_step_s``
        (a step's 99th percentile while several calls ran: the wait between two tokens)."""
        with self._cond:
            out = report(self._stats, self._steps)
            out["running_calls"], out["running_rows"] = len(self._running), self.scheduler.rows
            out["running_kv_bytes"] = self.scheduler.slab_bytes([c for c in self._running if not c.closed])
            out["parked_calls"] = sum(c.parked for c in self._running)
            out["waiting_calls"] = sum(isinstance(c, Call) for c in self._inbox)
        out["max_rows"], out["max_kv_bytes"] = self.max_rows, self.max_kv_bytes
        return out

    @property
    def running_hint(self) -> int:
        """Calls in the engine's steps now, read without the lock (a loop running inside a step may ask; the count
        may be one step old): speculation drafts only while few calls share a step."""
        return len(self._running)

    def waiting_calls(self) -> int:
        """Calls submitted and not decoding now: in the inbox (not admitted yet) or parked. Cheap, unlike
        :meth:`stats`, for a server's per-request queue check; a call still being set up is not counted."""
        with self._cond:
            return sum(isinstance(c, Call) for c in self._inbox) + sum(c.parked for c in self._running)

    def reset_stats(self) -> None:
        with self._cond:
            self._stats = new_counters()
            self._steps.clear()
