"""``cluster.run_batch``: one program over many inputs on Ray actors, results in input order.

::

    inputs ──(pulled lazily, a chunk per free actor slot)──▶ actor 1: make_program() once, then
                                                             continuum.run_batch(program, chunk) per chunk
                                                          ─▶ actor 2: ...
    results (input order) ◀── after every chunk came back ── errors gathered in ProgramError

Each actor builds the program once (``make_program()`` loads the model there) and runs every chunk it
receives with :func:`continuum.run_batch`, so the instances inside one actor share forwards. An actor
runs two chunks at once (a threaded actor): when one finishes, the driver sends the next while the other
keeps the model busy, so a slow actor simply takes fewer chunks. Results and exceptions are pickled one
by one inside the actor: a failed input arrives as the exception its program raised (its remote traceback
chained as ``__cause__``), never as Ray's ``RayTaskError``. Ctrl-C cancels the chunks in flight and kills
the actors. See ``docs/scaleout.md``.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..errors import ContinuumTypeError, GeneratorArgumentError, ProgramError
from ..programs.arguments import check_flags, check_int, check_program_and_inputs

__all__ = ["run_batch", "RemoteTraceback"]

_POLL = 0.1  # seconds per ray.wait: a pending Ctrl-C is delivered between two waits
_SLOTS = 2  # chunks one actor runs at once: one finishing while the other keeps the model busy


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ModuleNotFoundError('continuum.cluster needs Ray: pip install "continuum[cluster]"') from None
    return ray


def _check(make_program, inputs, actors, concurrency, cpus_per_actor, chunk_size, progress, return_exceptions) -> None:
    check_program_and_inputs(make_program, inputs, "cluster.run_batch(make_program, inputs)", "make_program",
                             "a callable of no arguments that returns the program (it runs once in each actor)")
    check_int("actors", actors, 1, "the number of Ray actors, each with its own model, e.g. 2")
    check_int("concurrency", concurrency, 1, "the most program instances run at once in one actor, e.g. 32")
    if chunk_size is not None:
        check_int("chunk_size", chunk_size, 1, "the inputs sent to an actor at once, or None to size them from concurrency")
    if isinstance(cpus_per_actor, bool) or not isinstance(cpus_per_actor, (int, float)):
        raise ContinuumTypeError(f"cpus_per_actor must be a number (the CPUs Ray reserves for each actor, e.g. 1), "
                                 f"got {type(cpus_per_actor).__name__}")
    if not cpus_per_actor >= 0:
        raise GeneratorArgumentError(f"cpus_per_actor must be >= 0 (the CPUs Ray reserves for each actor), got {cpus_per_actor}")
    check_flags(progress=progress, return_exceptions=return_exceptions)


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a Ray actor, chained as its ``__cause__`` on the caller's side
    (pickling drops tracebacks; this keeps where it happened in the printed chain)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


# ------------------------------------------------------------------ inside the actor
Packed = tuple[bool, bytes, str]  # (ok, pickled result or exception, the exception's traceback text)


def _pack_error(exc: BaseException) -> Packed:
    from ray import cloudpickle

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = cloudpickle.dumps(exc)
        cloudpickle.loads(blob)  # an exception class whose __init__ takes other arguments pickles but does not load
    except Exception:
        blob = cloudpickle.dumps(RuntimeError(f"{type(exc).__name__} raised in a Ray actor, which cannot be pickled "
                                              f"back to the caller: {exc}\n{text}"))
    return False, blob, text


def _pack_result(result: Any) -> Packed:
    from ray import cloudpickle

    from ..state import SequenceState

    if isinstance(result, SequenceState):  # it would pickle its model along: refuse it, say what to return
        return _pack_error(ContinuumTypeError(
            "the program returned a SequenceState, which cannot leave its Ray actor (it holds the model and its KV "
            "cache): return plain values instead, e.g. str(state) or state.value"))
    try:
        return True, cloudpickle.dumps(result), ""
    except Exception as exc:  # this input fails alone, not the whole chunk (Ray would fail the task)
        return _pack_error(ContinuumTypeError(f"the program returned a {type(result).__name__}, which cannot be pickled "
                                              f"back from its Ray actor ({type(exc).__name__}: {exc})"))


class _Actor:
    """One Ray actor: the program built once, then chunks of inputs run with :func:`continuum.run_batch`."""

    def __init__(self) -> None:
        self.program: Callable[[Any], Any] | None = None

    def setup(self, make_program: Callable[[], Callable[[Any], Any]]) -> Packed | None:
        """Build the program (a method, not ``__init__``: its exception arrives as raised, not as Ray's ActorDiedError)."""
        try:
            program = make_program()
            if not callable(program):
                raise ContinuumTypeError(f"make_program() must return the program, a callable of one input, got "
                                         f"{type(program).__name__}")
            self.program = program
        except BaseException as exc:
            return _pack_error(exc)
        return None

    def run(self, inputs: list, concurrency: int) -> list[Packed]:
        from ..programs.batch import run_batch

        assert self.program is not None  # (the driver sends chunks only once setup() returned)
        try:
            results, errors = run_batch(self.program, inputs, concurrency=concurrency), {}
        except ProgramError as exc:  # .results / .errors tell a raised exception from a returned one
            results, errors = exc.results, exc.errors
        return [_pack_error(errors[i]) if i in errors else _pack_result(r) for i, r in enumerate(results)]


# ------------------------------------------------------------------ on the caller's side
def _unpack(packed: Packed) -> tuple[bool, Any]:
    from ray import cloudpickle

    ok, blob, text = packed
    try:
        value = cloudpickle.loads(blob)
    except Exception as exc:  # e.g. a class the actor's environment has and the caller's has not
        ok, value = False, RuntimeError(f"a result of a Ray actor could not be unpickled here: {type(exc).__name__}: {exc}")
    if not ok and text:
        value.__cause__ = RemoteTraceback(text)
    return ok, value


class _Feed:
    """The inputs, pulled only when a chunk is sent (the first look ahead at most fills every actor's slots)."""

    def __init__(self, inputs: Iterable):
        self.it: Iterator = iter(inputs)
        self.buffer: list = []
        self.pulled = 0
        self.exhausted = False
        self.error: BaseException | None = None  # the inputs iterator itself raised: raise it at the end

    def _pull(self, n: int) -> None:
        while not self.exhausted and len(self.buffer) < n:
            try:
                self.buffer.append(next(self.it))
            except StopIteration:
                self.exhausted = True
            except BaseException as exc:
                self.exhausted, self.error = True, exc

    def known_total(self, look_ahead: int) -> int | None:
        """The number of inputs when there are at most ``look_ahead`` of them (so small runs split evenly)."""
        self._pull(look_ahead)
        return len(self.buffer) if self.exhausted and self.error is None else None

    def more(self) -> bool:
        """Whether an input is left to send."""
        self._pull(1)
        return bool(self.buffer)

    def take(self, n: int) -> tuple[int, list]:
        """(index of the first, up to ``n`` inputs)."""
        self._pull(n)
        chunk, self.buffer = self.buffer[:n], self.buffer[n:]
        first, self.pulled = self.pulled, self.pulled + len(chunk)
        return first, chunk


def _init_ray(ray: Any) -> None:
    if not ray.is_initialized():  # a local Ray instance on this machine; call ray.init(address=...) first for a cluster
        ray.init(include_dashboard=False, logging_level=logging.WARNING, configure_logging=True)


def _program_error(results: list, errors: dict[int, BaseException]) -> ProgramError:
    n, first = len(results), next(iter(errors))
    shown = ", ".join(map(str, list(errors)[:10])) + (", ..." if len(errors) > 10 else "")
    return ProgramError(
        f"{len(errors)} of {n} program instances failed (inputs {shown}); the first, input {first}, raised "
        f"{type(errors[first]).__name__}: {errors[first]}. The others finished: .results holds every result (None "
        f"where an instance failed) and .errors maps each failed input to its exception; pass "
        f"return_exceptions=True to get the exceptions in place instead", results=results, errors=errors)


def run_batch(make_program: Callable[[], Callable[[Any], Any]], inputs: Iterable, *, actors: int = 2,
              concurrency: int = 32, cpus_per_actor: float = 1, chunk_size: int | None = None, progress: bool = False,
              return_exceptions: bool = False) -> list:
    """Run the program built by ``make_program()`` over every input on ``actors`` Ray actors; results in input order.

    Each actor calls ``make_program()`` once (load the model and build the generators there: the model is
    never pickled) and runs the chunks of inputs it receives with :func:`continuum.run_batch`, up to
    ``concurrency`` instances at once, sharing forwards. Inputs are pulled lazily and sent in chunks as
    actors free up (each actor at most two chunks at a time), so a slow actor takes fewer. The results
    are those of ``continuum.run_batch(make_program(), inputs)`` in one process (greedy decoding).
    Starts a local Ray (``ray.init(include_dashboard=False)``) when Ray is not initialised; call
    ``ray.init(address=...)`` first to use a cluster. ``make_program``, the inputs and the results must
    pickle (a program returning a ``SequenceState`` fails that input: return ``str(state)`` or ``state.value``).

    Args:
        make_program: a callable of no arguments returning the program (a callable of one input).
        inputs: an iterable of inputs (a list, a generator...).
        actors: the number of Ray actors (each holds its own model).
        concurrency: the most instances running at once in one actor (>= 1).
        cpus_per_actor: the CPUs Ray reserves for each actor (``num_cpus``; 0 reserves none).
        chunk_size: inputs per chunk sent to an actor; default: half of ``concurrency``, smaller for few inputs.
        progress: show a tqdm bar (instances done, counted as chunks come back).
        return_exceptions: put a failed instance's exception in its place instead of raising.

    Returns:
        One result per input, in input order.

    Raises:
        ProgramError: after every instance finished, when some raised (unless ``return_exceptions``):
            ``.results`` (``None`` where an instance failed) and ``.errors`` (``{index: exception}``),
            each the exception the program raised in its actor.
        KeyboardInterrupt: Ctrl-C cancels the chunks in flight and kills the actors, then re-raises.
        ModuleNotFoundError: Ray is not installed (``pip install "continuum[cluster]"``).

    Example:
        >>> def make_program():                                                      # doctest: +SKIP
        ...     model = models.transformers("HuggingFaceTB/SmolLM2-135M")
        ...     summarize = generate.text(model, samplers.greedy())
        ...     return lambda doc: summarize(doc + "\\nSummary:", max_tokens=48)
        >>> summaries = cluster.run_batch(make_program, docs, actors=4, progress=True)   # doctest: +SKIP
    """
    _check(make_program, inputs, actors, concurrency, cpus_per_actor, chunk_size, progress, return_exceptions)
    ray = _ray()
    _init_ray(ray)
    try:
        total: int | None = len(inputs)  # type: ignore[arg-type]
    except TypeError:
        total = None
    slots = _SLOTS if concurrency >= _SLOTS else 1
    per_chunk = concurrency // slots  # a chunk's instances all run at once; an actor runs `concurrency` at most
    feed = _Feed(inputs)
    if chunk_size is None:
        known = total if total is not None else feed.known_total(actors * slots * per_chunk)
        # few inputs: split them over every slot of every actor, rather than one full chunk to the first actor
        chunk_size = per_chunk if known is None else max(1, min(per_chunk, math.ceil(known / (actors * slots))))
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    bar = _progress_bar(total) if progress else None
    handles: list[Any] = []
    starting: dict[Any, int] = {}  # setup ref -> actor
    running: dict[Any, tuple[int, int, int]] = {}  # chunk ref -> (actor, first index, size)
    load: dict[int, int] = {}  # chunks in flight per ready actor (setup returned)
    try:
        program_ref = ray.put(make_program)  # pickled once for every actor
        remote = ray.remote(_Actor).options(num_cpus=cpus_per_actor, max_concurrency=slots)
        for a in range(actors):
            handles.append(remote.remote())
            starting[handles[a].setup.remote(program_ref)] = a
        while True:
            for a in sorted(load, key=load.__getitem__):  # the least busy ready actor first
                while load[a] < slots:
                    first, chunk = feed.take(chunk_size)
                    if not chunk:
                        break
                    running[handles[a].run.remote(chunk, min(per_chunk, len(chunk)))] = (a, first, len(chunk))
                    load[a] += 1
            if not starting and not running:
                break
            done, _ = ray.wait([*starting, *running], num_returns=1, timeout=_POLL)
            for ref in done:
                if ref in starting:
                    a = starting.pop(ref)
                    failed = ray.get(ref)
                    if failed is not None:  # make_program raised in the actor: raise it here, as it was raised
                        raise _unpack(failed)[1]
                    load[a] = 0
                    continue
                a, first, size = running.pop(ref)
                try:
                    packed = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the actor died, or the chunk was cancelled: its inputs fail
                    cause = getattr(exc, "cause", None)
                    for i in range(first, first + size):
                        errors[i] = cause if isinstance(cause, BaseException) else exc
                    if isinstance(exc, ray.exceptions.RayActorError):
                        load.pop(a, None)
                        if not load and not starting and feed.more():  # no actor left to run the rest
                            raise
                    elif a in load:
                        load[a] -= 1
                    continue
                if a in load:  # (not when another of its chunks found it dead)
                    load[a] -= 1
                for i, p in enumerate(packed, start=first):
                    ok, value = _unpack(p)
                    if ok:
                        results[i] = value
                    else:
                        errors[i] = value
            if bar is not None and done:
                bar.n = len(results) + len(errors)
                bar.refresh()
    except BaseException:  # Ctrl-C (or an actor setup failure): stop everything still running
        for ref in running:
            try:
                ray.cancel(ref)
            except Exception:
                pass
        raise
    finally:
        for handle in handles:  # the actors and their models go with the call
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # (already dead)
                pass
        if bar is not None:
            bar.close()
    if feed.error is not None:
        raise feed.error
    n = feed.pulled
    errors = {i: errors[i] for i in sorted(errors)}
    if return_exceptions:
        return [errors[i] if i in errors else results.get(i) for i in range(n)]
    out = [results.get(i) for i in range(n)]
    if errors:
        first_error = errors[next(iter(errors))]
        raise _program_error(out, errors) from first_error
    return out


def _progress_bar(total: int | None) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="cluster.run_batch", unit="program")
