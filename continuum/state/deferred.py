"""``state + text`` on a joint call's caller, built when first read, so the next joint call adds it to all rows at once.

In a ``run_batch`` program every instance adds text to its rows of the last joint call (``s + "\\nMood:"``) and
hands the sum to the next call, which stacks all the instances' states again. Built one by one, that is a rebuild
per caller (for one row ~90 us of small tensor operations: 128 callers 11.7 ms on stories260K) and then a stack of
the sums (~6 ms), where a lockstep list call makes ONE sum of all its rows (0.7 ms). So the sum of a caller's rows
is recorded here (:class:`Deferred`: its real rows known, its tensors not made) and built when anything reads its
tensors; :func:`rejoin` stacks the sums of every caller of one joint call, in the order that call handed out its
rows, as ONE sum on the joint result: the rows, tokens and cache a lockstep list call has (``combine.stack``). A
program's prompt is the same (:class:`Prompt`): every instance's, stacked by its first joint call, are tokenized and
laid out at once, as a list call's prompts.

Example:
    >>> s = text(inputs, max_tokens=8) + "\\nMood:"   # in each program: a Deferred of its rows    # doctest: +SKIP
    >>> SequenceState.stack(sums)                      # the joint call: rejoin(sums), one rebuild   # doctest: +SKIP
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

from ..models.tokenizer import check_encodable
from .convert import unchanged_at
from .core import SequenceState
from .laststep import LastStep
from .layout import kept_rows, rebuild

__all__ = ["ORIGIN", "Deferred", "Part", "Prompt", "added", "part", "prompt", "rejoin", "mark"]

ORIGIN = "joint"  # a caller's rows of a joint call: its ``_cache[ORIGIN]`` is ``(joint result, first row, rows)``
_SLOTS = {name: SequenceState.__dict__[name] for name in ("_ids", "_mask", "_logprobs", "_kv")}
_Recipe = tuple[SequenceState, list[int], list[tuple[list[int], list[float]]], torch.Tensor, "LastStep | None"]
_lock = threading.RLock()  # (one build of a sum, whichever thread reads it first)


def _built(name: str) -> property:
    slot = _SLOTS[name]

    def get(self: _Lazy):
        if self._pending:
            self._build()
        return slot.__get__(self)

    return property(get, slot.__set__, doc=f"``{name}``, built from the recipe when first read")


class _Lazy(SequenceState):
    """A state whose tensors and cache are made when first read (``_make()``'s)."""

    __slots__ = ("_pending",)
    _pending: bool

    _ids = _built("_ids")
    _mask = _built("_mask")
    _logprobs = _built("_logprobs")
    _kv = _built("_kv")

    def _make(self) -> SequenceState:
        raise NotImplementedError

    def _build(self) -> None:
        with _lock:
            if not self._pending:
                return
            out = self._make()
            for slot in _SLOTS.values():
                slot.__set__(self, slot.__get__(out))
            for key, value in out._cache.items():
                self._cache.setdefault(key, value)
            self._pending = False


class Deferred(_Lazy):
    """``base + text`` where ``base`` is a caller's rows of a joint call: the per-row views (real tokens, texts) are
    known; the tensors and cache are :func:`~continuum.state.layout.rebuild`'s, made when first read."""

    __slots__ = ("_plan",)
    _plan: _Recipe

    def _make(self) -> SequenceState:
        return rebuild(*self._plan)

    def to_model(self, model) -> SequenceState:
        # (unbuilt, it is where its base is: the same device and cache; checked on the base, nothing built)
        base = self._plan[0]
        if self._pending and self._model is model and base.to_model(model) is base:
            return self
        return super().to_model(model)


class Prompt(_Lazy):
    """A prompt of a ``run_batch`` program, tokenized when first read, or with every other instance's by the joint
    call that stacks them (:func:`rejoin`: one tokenizer call and one layout for all, as a list call's prompts)."""

    __slots__ = ("_text",)
    _text: str

    def _make(self) -> SequenceState:
        return SequenceState.from_prompts(self._model, self._text)

    def to_model(self, model) -> SequenceState:
        # (unbuilt, it will be made on the model's own device)
        return self if self._pending and self._model is model else super().to_model(model)


class Part(_Lazy):
    """A caller's rows of a joint call's result (``coalesce._split``): its ids, mask and log-probs are views of the
    joint result's, made when first read. A ``run_batch`` program mostly adds text to its part or hands it on, and
    :func:`rejoin` then works on the joint result: 4 slices per caller (~25 us; 3 ms per 128 callers) never made."""

    __slots__ = ("_view",)
    _view: tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice, slice]

    _kv = _SLOTS["_kv"]  # (known at once: the joint cache's rows, ``kv.split_rows``; reading it builds nothing)

    def _make(self) -> SequenceState:
        ids, mask, logprobs, rows, cols = self._view
        return SequenceState(model=self._model, ids=ids[rows, cols], mask=mask[rows, cols], logprobs=logprobs[rows, cols],
                             weights=self._weights, kv=self._kv, batch=self.batch, samples=self.samples, last=self._last)

    def to_model(self, model) -> SequenceState:
        # (unbuilt, it is where the joint result is: checked on the joint ids' device and its own cache)
        if self._pending and self._model is model and unchanged_at(self._view[0].device, self._kv, model):
            return self
        return super().to_model(model)


def part(joint: SequenceState, row: int, n: int, lead: int, kv, batch: int, last: LastStep | None) -> SequenceState:
    """The rows ``row:row + n`` of ``joint`` from column ``lead`` on, with cache ``kv``, unbuilt (:class:`Part`); it
    takes ``joint``'s memoised per-row views of those rows."""
    out = object.__new__(Part)
    rows = slice(row, row + n)
    out._model, out._weights, out.batch, out.samples, out._last = joint._model, joint._weights[rows], batch, joint.samples, last
    out._cache, out._pending = {}, True
    out._view = (joint._ids, joint._mask, joint._logprobs, rows, slice(lead, None))
    _SLOTS["_kv"].__set__(out, kv)
    return out._memo_from(joint, rows)


def prompt(model, text: str) -> SequenceState:
    """``SequenceState.from_prompts(model, text)``, tokenized when first read (:class:`Prompt`)."""
    check_encodable(text, "prompt")  # (refused at the call, as from_prompts does)
    out = object.__new__(Prompt)
    out._model, out._weights, out.batch, out.samples, out._last = model, torch.zeros(1), 1, 1, None
    out._cache, out._text, out._pending = {}, text, True
    return out


def added(base: SequenceState, keep: list[int], tails: list[tuple[list[int], list[float]]],
          last: LastStep | None) -> SequenceState | None:
    """``base`` with ``tails`` after its first ``keep[r]`` cached tokens, unbuilt; None where it must be built now: the
    base is not a joint call's caller, or a row's tail is empty (``rebuild`` then moves a cached token into it)."""
    if ORIGIN not in base._cache or not all(t for t, _ in tails):
        return None
    out = object.__new__(Deferred)
    out._model, out._weights, out.batch, out.samples, out._last = base._model, base._weights, base.batch, base.samples, last
    out._cache = {"real": kept_rows(base._real_rows(), keep, tails)}
    out._plan, out._pending = (base, keep, tails, base._weights, last), True
    return out


def rejoin(states: Sequence[SequenceState]) -> SequenceState | None:
    """``states`` stacked, when they are every caller's rows of one joint call, in the order it handed them out, each
    as it was or with text added (:func:`added`): the joint result itself, or ONE sum on it (what a list call over the
    same rows makes), instead of a sum per caller and a stack. None otherwise."""
    first = states[0]
    if isinstance(first, Prompt):  # (every instance's prompt: one tokenizer call and one layout for all)
        texts = [s._text for s in states if isinstance(s, Prompt) and s._model is first._model]
        return SequenceState.from_prompts(first._model, texts) if len(texts) == len(states) else None
    origin = _origin(first._plan[0] if isinstance(first, Deferred) else first)
    if origin is None:
        return None
    joint, row = origin[0], 0
    keep: list[int] = []
    tails: list[tuple[list[int], list[float]]] = []
    plain = not isinstance(first, Deferred)
    for s in states:
        if isinstance(s, Deferred):
            if plain:  # (all as they were, or all with text added)
                return None
            base = s._plan[0]
            keep += s._plan[1]
            tails += s._plan[2]
        elif plain:
            base = s
        else:
            return None
        at = _origin(base)
        if at is None or at[0] is not joint or at[1] != row or s._model is not joint._model:
            return None
        row += at[2]
    if row != joint.rows:
        return None
    if plain:
        return joint
    last = joint._last.edited() if joint._last is not None else None
    return rebuild(joint, keep, tails, joint._weights, last)


def mark(parts: Sequence[SequenceState], joint: SequenceState, spans: Sequence[tuple[int, int]],
         own: Sequence[bool]) -> None:
    """Record each part as the rows ``spans[i]`` (first row, rows) of ``joint`` (``coalesce._split``). A part whose
    cache is a view of the joint cache holds ``joint`` (it pins that storage anyway); one with a cache of its own (a
    short row) knows it weakly, so it never keeps a long row's storage alive: a cohort with a view among its callers
    keeps the joint result alive until the next joint call."""
    for part, (row, n), alone in zip(parts, spans, own):
        part._cache[ORIGIN] = (weakref.ref(joint) if alone else joint, row, n)


def _origin(state: SequenceState) -> tuple[SequenceState, int, int] | None:
    at = state._cache.get(ORIGIN)
    if at is None or not isinstance(at[0], weakref.ref):
        return at
    joint = at[0]()
    return None if joint is None else (joint, at[1], at[2])
