"""Calls of one generator that arrive together run as ONE list call: ``run_batch``'s programs in lockstep.

The instances of a ``run_batch`` program make the same calls at about the same time (a chain's next call
in every instance at once). Alone, each call pays its own Python: the state's text re-tokenized, the checks,
its rows, choice scoring's tree and softmax, its finish (~1-3 ms a call, issue 57), while a list call over
the same rows pays it once. So a call made inside a ``run_batch`` program (or handed to a worker thread as one is:
``acall``, a server's requests; :class:`~.arrivals.Handoff`) waits, as the engine's step does
(:mod:`.arrivals`), while other instances are on their way to a call; every call of the same generator, with
the same arguments, that arrived meanwhile runs as one call on the stacked states
(:meth:`~continuum.SequenceState.stack`), and each caller gets its own rows back, as a state of its own
(views of the joint result, or a copy of its rows: :func:`_split`). A list call computes each row as it would alone
(invariant 1), so the callers get what they would alone.

Only calls whose result cannot depend on their company join: greedy sampling (a draw would depend on which
rows share the random stream), no ``rng``, no unfinished constrained step to resume in the input (its guide
state is per call), one process (under torchrun every rank must make the same calls), not llama.cpp's
batch-invariant mode (it promises bits alone, and a list call's torch ops over more rows may round differently;
a ``models.remote`` joins when its server says its model does, ``joins`` in ``GET /v1/continuum/model``: the
joint call is then ONE request). The first caller of a cohort leads: it waits for the others (while they keep
coming, at most ``GATHER_S``), runs the joint call and hands each follower its rows; where the joint call fails,
every caller runs its own call alone, so an error reaches only its owner, as without this.

Example:
    >>> continuum.run_batch(lambda x: choose(text(x, max_tokens=8) + "\\nMood:").value, inputs)   # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ..models import kv as kvcache
from ..samplers import GreedySampler
from ..state import SequenceState, deferred
from .arrivals import ARRIVALS, GATE, GATHER_CAP_S
from .cancel import Cancelled, current

__all__ = ["key_of", "run", "joint", "cap", "stats", "reset_stats", "ENABLED", "MAX_ROWS"]

ENABLED = True  # False: every call runs its own loop, merged only by the engine's steps (tests of that path)
MAX_ROWS = 256  # rows of one joint call (at most the engine's max_rows: 32 on llama.cpp); a cohort past it starts a
# second joint call, and they share the engine's steps (measured on Gemma, llama.cpp: 128-row joint calls in turns
# ran at 156-177 tokens/s, four 32-row ones side by side as fast as 128 calls merged by the engine)
GATHER_S, GATHER_NEXT_S = 1.0, 0.02  # the longest a leader waits for its cohort while its members keep arriving,
# each within GATHER_NEXT_S of the last (only the cohort waits: its members' Python runs meanwhile); a handed-off call
# (acall, a server's request: arrivals.Handoff) waits at most arrivals.GATHER_MAX_S

_lock = threading.Lock()
_open: dict[tuple, _Cohort] = {}  # the cohort each key's next caller joins, while its leader waits
_counts = {"joint_calls": 0, "calls_joined": 0, "joint_failures": 0}


def stats() -> dict:
    """Joint calls run so far in this process (``joint_calls``), the callers' calls they ran (``calls_joined``), and
    joint calls that failed and ran each caller alone (``joint_failures``)."""
    with _lock:
        return dict(_counts)


def reset_stats() -> None:
    with _lock:
        for k in _counts:
            _counts[k] = 0


class _Cohort:
    """The calls that run as one: their input states in arrival order, then each one's result."""

    __slots__ = ("generator", "states", "rows", "done", "results", "failed")

    def __init__(self, generator: Any):
        self.generator = generator  # (held: the key names it by id)
        self.states: list[SequenceState] = []
        self.rows = 0
        self.done = threading.Event()
        self.results: list[SequenceState] = []
        self.failed = False


def key_of(generator: Any, state: SequenceState, max_tokens: int | None, stop_at: Any, rng: Any) -> tuple | None:
    """What calls share to run as one (the generator, its arguments, the caller's run), or None: this call runs
    alone (not inside a ``run_batch`` program or a handoff, or its result could depend on its company; see the module)."""
    if not ENABLED or rng is not None or not ARRIVALS.in_program() or not isinstance(generator.sampler, GreedySampler):
        return None
    last = state._last
    model = generator.model
    if (last is not None and last.guide_states is not None) \
            or (getattr(model, "runs_calls", False) and not getattr(model, "joins", False)) \
            or getattr(getattr(model, "llama", None), "batch_invariant", False) or _several_ranks():
        return None
    token = current()
    stops = tuple(stop_at) if isinstance(stop_at, (list, tuple)) else stop_at
    return (id(generator), max_tokens, stops, state.samples, id(token.parent) if token is not None else None)


def cap(generator: Any) -> int:
    """The most rows of one joint call of ``generator`` (a cohort past it starts another)."""
    return min(MAX_ROWS, getattr(getattr(generator.model, "engine", None), "max_rows", MAX_ROWS))


def joint(states: list[SequenceState], alone: Callable[[SequenceState], SequenceState]) -> list[SequenceState] | None:
    """Each state's rows of ONE call on the stacked states (``alone(stack)``), or None when the joint call failed (then
    every caller runs its own call alone, so an error reaches only its owner, and a cancellation stops each)."""
    try:
        results: list[SequenceState] | None = _split(alone(SequenceState.stack(states)), states)
    except (Exception, Cancelled):
        results = None
    with _lock:
        _counts["joint_calls"] += 1
        _counts["calls_joined"] += len(states)
        _counts["joint_failures"] += results is None
    return results


def run(key: tuple, generator: Any, state: SequenceState, alone: Callable[[SequenceState], SequenceState]) -> SequenceState:
    """``alone(state)``, run jointly with the calls of the same ``key`` that arrive meanwhile (threads: a
    ``run_batch(threads=True)`` program, a handed-off call; the default ``run_batch`` gathers its cohorts itself,
    :mod:`continuum.programs.lockstep`)."""
    rows_cap = cap(generator)
    with _lock:
        cohort = _open.get(key)
        leader = cohort is None or cohort.rows + state.rows > rows_cap
        if leader:
            cohort = _open[key] = _Cohort(generator)
        assert cohort is not None
        index = len(cohort.states)
        cohort.states.append(state)
        cohort.rows += state.rows
    ARRIVALS.arrived()  # (waiting here: the engine's steps and the other leaders do not wait for this thread)
    if not leader:
        with GATE.waiting():
            cohort.done.wait()
        ARRIVALS.claim()  # (the leader counted this thread as arriving again: it goes on in its program)
        return alone(state) if cohort.failed else cohort.results[index]
    with GATE.waiting():
        ARRIVALS.gather(GATHER_CAP_S, ARRIVALS.patience(GATHER_S), GATHER_NEXT_S)  # the rest of the cohort on its way
    with _lock:
        if _open.get(key) is cohort:
            del _open[key]
    states = cohort.states  # (closed: nobody joins a cohort that left _open)
    ARRIVALS.arrive()  # (setting up the joint call)
    try:
        if len(states) == 1:
            return alone(state)
        results = joint(states, alone)
        cohort.failed = results is None
        cohort.results = results or []
    finally:
        for _ in range(len(states) - 1):
            ARRIVALS.expect()  # (each follower is on its way to its next call from now)
        cohort.done.set()
    return alone(state) if cohort.failed else cohort.results[0]


def _split(joint: SequenceState, states: list[SequenceState]) -> list[SequenceState]:
    """Each caller's rows of the joint result (batch-major: a caller's batch items and their samples together).

    On transformers a caller's rows are lazy views of the joint result (its tensors, and its cache: ``kv.split_rows``,
    no view made until someone reads them, and stacking them for the next joint call gathers from the joint cache
    directly), each without the leading columns that are padding in all its rows; callers whose rows are less than
    half the joint cache's width get their caches in storage of their own, shared by them only (one copy for all of
    them), so a short row never keeps a long one's storage alive. Another backend's handle selects its rows
    (``_select``)."""
    samples = joint.samples
    C = kvcache.length(joint._kv)
    real = joint._mask != 0
    first = real.to(torch.int8).argmax(1).tolist()  # each row's first real column
    # views: transformers' tensors, and an uncached suffix real in every row (right-aligned; else _select drops holes)
    views = (joint._kv is None or kvcache.tensors(joint._kv) is not None) and bool(real[:, C:].all())
    if not views:
        out, row = [], 0
        for s in states:
            out.append(joint._select(range(row, row + s.batch * samples), s.batch, samples))
            row += s.batch * samples
        return out
    joint._cached_real()  # (each caller's cached counts are its rows' of these: one read, not one per caller)
    spans, row = [], 0
    for s in states:
        n = s.batch * samples
        spans.append((row, n, min(min(first[row:row + n]), C)))
        row += n
    cached = [lead < C for _, _, lead in spans]
    kvs: list = [None] * len(states)
    own = [2 * (C - lead) < C for _, _, lead in spans]
    if joint._kv is not None and any(cached):
        at = [i for i, c in enumerate(cached) if c]
        for i, kv in zip(at, kvcache.split_rows(joint._kv, [spans[i] for i in at], [own[i] for i in at])):
            kvs[i] = kv
    rows = [(row, n) for row, n, _ in spans]
    lasts = joint._last.spans(rows) if joint._last is not None else [None] * len(states)
    # (tensors made when first read; the columns dropped hold no real token in its rows)
    out = [deferred.part(joint, row, n, lead, kv, s.batch, last)
           for s, (row, n, lead), kv, last in zip(states, spans, kvs, lasts)]
    deferred.mark(out, joint, rows, own)
    return out


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
