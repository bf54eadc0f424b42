"""``run_batch``: run one program over many inputs, many instances at once, results in input order.

::

    inputs ──(pulled lazily, one per free slot)──▶ concurrency instances ──▶ program(x)
                                                     │ in lockstep on one thread (programs/lockstep.py),
                                                     │ or a thread each (threads=True); every generator
                                                     │ call is a decoding loop, and concurrent loops on
                                                     ▼ one model share forwards
    results (input order) ◀── after every instance finished ── errors gathered in ProgramError

A program is any Python function of one input that calls continuum generators (plain, continuous,
chats) and branches on their outputs. The instances run in lockstep on one thread (each until its next
call; their calls then run together, a cohort of the same greedy call as ONE list call), or each on a
worker thread; the decoding loops of the calls are run by the model's engine, one step for all of them
(see ``docs/scheduler.md``), so the program is written for one input and runs batched. Ctrl-C
(``KeyboardInterrupt`` in the calling thread) cancels every instance at its next decoding step
(:mod:`continuum.loop.cancel`) and re-raises once they have all left the model. See ``docs/concurrency.md``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from typing import Any

from ..errors import ProgramError
from ..loop.arrivals import ARRIVALS
from ..loop.cancel import Cancelled, CancelToken, bound, check_cancelled, current
from ..loop.host import HOST
from ..loop.ranks import call_key, current_key
from .arguments import check_flags, check_int, check_program_and_inputs
from .heap import frozen_heap
from .lockstep import AVAILABLE, Lockstep
from .lockstep import current as current_instance

__all__ = ["run_batch", "check_cancelled"]

_POLL = 0.1  # seconds between two looks of the waiting thread (progress bar, a simulated Ctrl-C)

SERIAL_UNDER_TORCHRUN = False
"""Under torchrun (a process group of several ranks), run the instances one at a time, in input order.

Every rank must run the same forwards in the same order (tensor parallelism exchanges activations at
every layer), and threads reach the model in a different order on each rank. The engine decides
which calls join every step on rank 0 and broadcasts it (:mod:`continuum.loop.ranks`), keyed by each
instance's ``call_key`` (set here, per input index), so concurrent instances are safe there: this
switch (off) only forces the one-at-a-time fallback, e.g. to rule the coordination out while debugging."""


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _check(program, inputs, concurrency, progress, return_exceptions, threads) -> None:
    check_program_and_inputs(program, inputs, "run_batch(program, inputs)", "program",
                             "a callable of one input (e.g. def program(doc): ...)")
    check_int("concurrency", concurrency, 1, "the most program instances run at once, e.g. 32")
    check_flags(progress=progress, return_exceptions=return_exceptions, threads=threads)


class _Run:
    """One ``run_batch`` call: the input feed, the worker threads and what they produced."""

    def __init__(self, program: Callable[[Any], Any], inputs: Iterator, concurrency: int, threads: bool):
        self.parent = current_key()  # nested run_batch: instance keys stay distinct from the outer ones
        self.program, self.inputs, self.limit, self.threads = program, inputs, concurrency, threads
        self.token = CancelToken(parent=current())  # a nested run_batch stops with its caller's
        self.lock = threading.Lock()
        self.count = itertools.count()
        self.exhausted = False
        self.feed_error: BaseException | None = None  # the inputs iterator itself raised
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.done = 0
        self.tokens: list[CancelToken] = []  # one per worker: its cancellation (child of self.token) and token count
        self.alive = 0
        self.finished = threading.Event()
        self.crash: BaseException | None = None  # the lockstep runner itself failed (a bug): raised by run_batch
        self.host: Any = None  # loop/host.HOST while this run's caller hosts the engines' steps

    def inline(self, fn: Callable[[], Any]) -> bool:
        """Run the lockstep's one call out, ``fn``, in this run's caller, which hosts the engines' steps: the call's
        setup and finish compute on the thread that computes the steps (loop/host.py); False when it does not host."""
        host = self.host
        return host is not None and host.run(fn)

    def token_of(self, x: Any) -> None:
        return None  # (slot tokens: new_token)

    def run_one(self, index: int, x: Any) -> bool:
        """One instance: ``program(x)``, its result or error kept; False when it was cancelled."""
        try:
            self.results[index] = self.program(x)
        except Cancelled:
            return False
        except BaseException as exc:  # one instance's failure never disturbs the others
            self.errors[index] = exc
        with self.lock:
            self.done += 1
        return True

    def new_token(self) -> CancelToken:
        """A worker's (or a lockstep slot's) token: its cancellation (a child of the run's) and its token count."""
        token = CancelToken(parent=self.token)
        self.tokens.append(token)
        return token

    def _spawn(self) -> None:
        """Start one more worker (called with the lock held). Workers are started one per input pulled, up to
        ``concurrency``: three inputs start at most four threads, whatever ``concurrency`` is. In lockstep, the one
        runner thread (programs/lockstep.py)."""
        self.alive += 1
        ARRIVALS.expect()  # (on its way to the engine from now: the worker claims the count when it starts)
        if not self.threads:
            threading.Thread(target=self._lockstep, name="continuum-run_batch", daemon=True).start()
            return
        token = self.new_token()
        threading.Thread(target=self._work, args=(token,), name=f"continuum-run_batch-{len(self.tokens) - 1}",
                         daemon=True).start()  # daemon: a program stuck outside continuum never blocks the exit

    def next_input(self) -> tuple[int, Any] | None:
        """The next (index, input), pulled only now (a generator of inputs is never run ahead)."""
        with self.lock:
            if self.exhausted or self.token.cancelled:
                return None
            try:
                x = next(self.inputs)
            except StopIteration:
                self.exhausted = True
                return None
            except BaseException as exc:  # the iterator failed: start nothing more, raise it at the end
                self.exhausted, self.feed_error = True, exc
                return None
            return next(self.count), x

    def _next(self) -> tuple[int, Any] | None:
        item = self.next_input()
        if item is not None:
            with self.lock:
                if len(self.tokens) < self.limit:  # the next input may find a free worker
                    self._spawn()
        return item

    def _lockstep(self) -> None:
        ARRIVALS.claim()
        try:
            Lockstep(self).run()
        except BaseException as exc:  # noqa: BLE001  (a bug in the runner: raised in the caller, never a hang)
            self.crash = exc
        finally:
            ARRIVALS.arrived()
            self._left()

    def _work(self, token: CancelToken) -> None:
        ARRIVALS.claim()
        try:
            with bound(token):
                while (item := self._next()) is not None:
                    i, x = item
                    # names this instance's forwards alike on every rank; counts it as arriving (the engine's next
                    # step waits a little for it) whenever it runs outside the engine
                    with call_key((self.parent, i)), ARRIVALS.program():
                        if not self.run_one(i, x):
                            break
        finally:
            ARRIVALS.arrived()  # (no more inputs: no more calls from this worker)
            self._left()

    def _left(self) -> None:
        with self.lock:
            self.alive -= 1
            if self.alive == 0:
                self.finished.set()
                HOST.nudge()  # (the caller, hosting, sleeps on the host's condition)

    def wait(self, progress: bool, total: int | None) -> None:
        """Start the workers and wait for them; on Ctrl-C, cancel them all, wait until they left, re-raise."""
        bar = _progress_bar(total) if progress else None
        start = time.perf_counter()
        try:
            # (a nested run_batch: its caller's program waits for workers, not the engine; a caller outside any
            # program drives the engines' steps meanwhile, and runs a lockstep's lone calls: loop/host.py)
            with ARRIVALS.away(), HOST.hosting() if not ARRIVALS.in_program() else nullcontext() as host:
                self.host = host
                try:
                    with self.lock:
                        self._spawn()
                    while not self.finished.is_set():  # (a pending Ctrl-C is delivered between two waits)
                        if host is not None:
                            host.serve(_POLL, self.finished)
                        else:
                            self.finished.wait(_POLL)
                        if bar is not None:
                            _update(bar, self.done, sum(t.tokens for t in self.tokens), time.perf_counter() - start)
                finally:
                    self.host = None  # (a call the runner hands over later goes to a call thread)
        except BaseException:  # KeyboardInterrupt (or anything raised in this thread): stop every instance
            self.token.cancel()
            with self.lock:
                if self.alive == 0:  # interrupted before the first worker started
                    self.finished.set()
            while not self.finished.wait(_POLL):  # each leaves at its next decoding step; a 2nd Ctrl-C stops waiting
                pass
            raise
        finally:
            if bar is not None:
                _update(bar, self.done, sum(t.tokens for t in self.tokens), time.perf_counter() - start)
                bar.close()
        if self.token.cancelled:  # a nested run_batch whose caller was cancelled
            raise Cancelled()


def _progress_bar(total: int | None):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="run_batch", unit="program")


def _update(bar, done: int, tokens: int, seconds: float) -> None:
    bar.n = done
    bar.set_postfix_str(f"{tokens / max(seconds, 1e-9):.1f} tok/s", refresh=False)
    bar.refresh()


def run_batch(program: Callable[[Any], Any], inputs: Iterable, *, concurrency: int = 32, progress: bool = False,
              return_exceptions: bool = False, threads: bool = False) -> list:
    """Run ``program(x)`` for every ``x`` in ``inputs``, up to ``concurrency`` instances at once; results in input order.

    The instances run in lockstep on one thread (:mod:`continuum.programs.lockstep`): each runs until its next
    generator call, and when none can go on, their calls run, concurrent calls on one model sharing forwards, so a
    program written for one input runs batched, and every instance returns what it returns alone (give a sampling
    call its own ``rng`` for that). Greedy calls of one generator with the same arguments that the instances make
    together run as ONE list call, each instance getting its own rows back (:mod:`continuum.loop.coalesce`,
    docs/concurrency.md). Inputs are pulled one at a time as instances finish: a generator of a million inputs never
    holds more than ``concurrency`` running instances.

    Args:
        program: a function of one input (it may call any continuum generators, chats, branch, loop).
        inputs: an iterable of inputs (a list, a generator...).
        concurrency: the most instances running at once (>= 1).
        progress: show a tqdm bar (instances done, generated tokens per second).
        return_exceptions: put a failed instance's exception in its place instead of raising.
        threads: run each instance on a thread of its own, for programs that block outside continuum between
            their calls (a web request, a file, a sleep): in lockstep such a wait holds every instance.

    Returns:
        One result per input, in input order.

    Raises:
        ProgramError: after every instance finished, when some raised (unless ``return_exceptions``):
            ``.results`` (``None`` where an instance failed) and ``.errors`` (``{index: exception}``).
        KeyboardInterrupt: Ctrl-C stops every instance at its next decoding step; the model stays usable.

    Example:
        >>> def program(doc):                                                        # doctest: +SKIP
        ...     summary = summarize(doc, max_tokens=48)
        ...     return pick(summary + "\\nLabel:")
        >>> labels = continuum.run_batch(program, docs, concurrency=32, progress=True)   # doctest: +SKIP
    """
    _check(program, inputs, concurrency, progress, return_exceptions, threads)
    instance = current_instance()
    if instance is not None:  # nested in a lockstep program: run on a call thread while this instance waits
        return instance.offload(lambda: run_batch(program, inputs, concurrency=concurrency, progress=progress,
                                                  return_exceptions=return_exceptions, threads=threads))
    try:
        total: int | None = len(inputs)  # type: ignore[arg-type]
    except TypeError:
        total = None
    ranks = _several_ranks()
    if SERIAL_UNDER_TORCHRUN and ranks:
        concurrency = 1
    # (under torchrun every rank names an instance's forwards by its thread's call_key: a thread per instance)
    run = _Run(program, iter(inputs), concurrency, threads or ranks or not AVAILABLE)
    with frozen_heap():  # (no full collection walks the imports' objects while the programs run)
        run.wait(progress, total)
    if run.crash is not None:
        raise run.crash
    if run.feed_error is not None:
        raise run.feed_error
    n = next(run.count)
    errors = {i: run.errors[i] for i in sorted(run.errors)}
    if return_exceptions:
        return [errors[i] if i in errors else run.results.get(i) for i in range(n)]
    results = [run.results.get(i) for i in range(n)]
    if errors:
        first = next(iter(errors))
        shown = ", ".join(map(str, list(errors)[:10])) + (", ..." if len(errors) > 10 else "")
        raise ProgramError(
            f"{len(errors)} of {n} program instances failed (inputs {shown}); the first, input {first}, raised "
            f"{type(errors[first]).__name__}: {errors[first]}. The others finished: .results holds every result (None "
            f"where an instance failed) and .errors maps each failed input to its exception; pass "
            f"return_exceptions=True to get the exceptions in place instead", results=results, errors=errors) from errors[first]
    return results
