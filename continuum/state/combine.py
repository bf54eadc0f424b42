"""Combining states: ``state + text``, ``text + state``, ``state + state`` and stacking along the batch axis."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..errors import BatchMismatch, ContinuumTypeError, SampleMismatch
from ..loop.arrivals import gated
from ..models import kv as kvcache
from ..models.tokenizer import check_encodable
from . import convert, deferred, stacking
from .convert import check_same_model
from .core import _NAN, VIEWS, SequenceState

__all__ = ["add", "radd", "stack"]

_ARGUMENT = {"adding": "the text added to the state", "prepending": "the text put before the state"}
_ADDABLE = "a str, a list of str (one per batch row) or another SequenceState (same tokenizer)"


def _not_addable(other, op: str) -> ContinuumTypeError:
    hint = ": decode it first, e.g. data.decode('utf-8')" if isinstance(other, (bytes, bytearray)) else ""
    return ContinuumTypeError(f"cannot {op} an object of type {type(other).__name__} to a SequenceState; "
                              f"it takes {_ADDABLE}{hint}")


def per_row_texts(state: SequenceState, other: str | Sequence[str], op: str) -> list[str]:
    if isinstance(other, str):
        check_encodable(other, _ARGUMENT[op])
        return [other] * state.rows
    other = list(other)
    if len(other) != state.batch:
        raise BatchMismatch(f"{op} a list of {len(other)} strings to a state with batch={state.batch}: "
                            f"give one string per batch row, or a single string for all rows")
    if not all(isinstance(t, str) for t in other):
        bad = next(t for t in other if not isinstance(t, str))
        raise ContinuumTypeError(f"{op} a list with an item of type {type(bad).__name__}: a state takes {_ADDABLE}")
    check_encodable(other, _ARGUMENT[op] + ": item")
    return [other[r // state.samples] for r in range(state.rows)]

@gated  # (state + text in 128 threads at once: few in continuum's Python, loop/arrivals.Gate)
def add(state: SequenceState, other) -> SequenceState:
    """``state + other``: append text (one string, one per batch row) or another state's text."""
    own: list[list[int]] | None = None
    if isinstance(other, SequenceState):
        check_compatible(state, other)
        appended = other.texts
        weights = state._weights + other._weights.to(state._weights.device)
        own = [[i for i in ids if i not in state._model.tokenizer.special_ids] for ids, _ in other._real_rows()]
    elif isinstance(other, (str, list, tuple)):
        appended = per_row_texts(state, other, "adding")
        weights = state._weights
    else:  # raised here rather than NotImplemented: Python's generic message names no accepted type
        raise _not_addable(other, "add")
    tok, real, cached = state._model.tokenizer, state._real_rows(), state._cached_real()
    tails = []
    for r in range(state.rows):
        ids, lps = real[r]
        extra = tok.encode_continuation(appended[r])
        if extra and no_text(tok, ids):
            extra = first_text(tok, ids, extra, appended[r])
        if own is not None and extra != own[r]:
            extra = faithful(tok, ids, extra, own[r], appended[r])
        tails.append((ids[cached[r]:] + extra, lps[cached[r]:] + [_NAN] * len(extra)))
    last = state._last.edited() if state._last else None
    if own is None:  # (text on a joint call's caller: built when read, or with its cohort's by the next joint call)
        later = deferred.added(state, cached, tails, last)
        if later is not None:
            return later
    return state._rebuild(cached, tails, weights, last)

def no_text(tok, ids: list[int]) -> bool:
    """Whether a row's tokens hold no text yet (only special tokens, e.g. ``<s>``)."""
    return all(i in tok.special_ids for i in ids)


def first_text(tok, ids: list[int], extra: list[int], text: str) -> list[int]:
    """Tokens for ``text`` appended to a row with no text yet (only special tokens, e.g. ``<s>``).

    A SentencePiece decoder drops the leading space of a row's first piece, so ``" cd"`` encoded as a
    continuation (``▁cd``) would read ``"cd"`` there. Encoding one more space keeps the text: the
    decoder strips the extra one (``▁ ▁cd`` reads ``" cd"``). Other tokenizers keep ``extra``.
    """
    if tok.decode(ids + extra) == text:
        return extra
    spaced = tok.encode_continuation(" " + text)
    return spaced if tok.decode(ids + spaced) == text else extra


def faithful(tok, ids: list[int], extra: list[int], own: list[int], text: str) -> list[int]:
    """Tokens for another state's ``text`` (its tokens ``own``, specials left out) appended to ``ids``.

    Re-encoding is the rule (the joined row then tokenizes as its text would), but a tokenizer's normalizer may
    rewrite generated text: NFC reads U+F92E, which a model can spell in byte tokens, as U+51B7. Where the
    re-encoded row reads other than the two texts joined and the other state's own tokens read right, those
    are kept. Compared joined, not alone: a SentencePiece decoder drops a row's first leading space, so a
    continuation read alone loses a space the joined row keeps."""
    want = tok.decode(ids) + text
    if tok.decode(ids + extra) == want or tok.decode(ids + own) != want:
        return extra
    return own


def lead_space(state: SequenceState) -> SequenceState:
    """``state`` with a space piece appended to each row with no text yet (only special tokens), when the
    tokenizer's decoder drops that row's first leading space (SentencePiece): ``<s> ▁`` reads ``""``, and what
    follows then reads as its pieces spell it. A guided step starting there walks its pattern over the pieces'
    text, so without it ``▁ 2 0 0`` (`` 200`` to a ``' [0-9]{3}'`` guide) would read ``"200"``: not a match.
    ``state`` itself when no row needs it."""
    tok, real = state._model.tokenizer, state._real_rows()
    empty = [r for r, (ids, _) in enumerate(real) if no_text(tok, ids)]
    if not empty:
        return state
    piece = tok.encode_continuation(" ")
    ids = real[empty[0]][0]
    if len(piece) != 1 or tok.decode(ids + piece) != "" or tok.decode(ids + piece + piece) != " ":
        return state  # (the decoder keeps a first leading space: nothing to make up for)
    cached = state._cached_real()
    tails = [(ids[cached[r]:] + (piece if r in empty else []), lps[cached[r]:] + ([_NAN] if r in empty else []))
             for r, (ids, lps) in enumerate(real)]
    return state._rebuild(cached, tails, state._weights, state._last)


@gated
def radd(state: SequenceState, other) -> SequenceState:
    """``text + state``: prepend text; the result is re-tokenized as a prompt (no cache)."""
    if not isinstance(other, (str, list, tuple)):
        raise _not_addable(other, "prepend")
    prefixes = per_row_texts(state, other, "prepending")
    texts = state.texts
    rows = state._model.tokenizer.encode_prompts([p + t for p, t in zip(prefixes, texts)])
    last = None
    if state._last is not None:
        last = state._last.edited(starts=tuple(s + len(prefixes[r]) for r, s in enumerate(state._last.starts)),
                       ends=tuple(e + len(prefixes[r]) for r, e in enumerate(state._last.ends)))
    return SequenceState._from_rows(state._model, rows, [[_NAN] * len(x) for x in rows], state._weights,
                                    state.batch, state.samples, last)

def check_compatible(state: SequenceState, other: SequenceState) -> None:
    check_same_model(state, other, "add")
    if other.batch != state.batch:
        raise BatchMismatch(f"cannot add a state with batch={other.batch} to one with batch={state.batch}; "
                            f"select matching rows first, e.g. other[:{state.batch}, ...]")
    if other.samples != state.samples:
        raise SampleMismatch(f"cannot add a state with samples={other.samples} to one with samples={state.samples}; "
                             f"select one sample (state[:, i, :]) or continue with a {state.samples}-sample generator")


def concat_samples(states: Sequence[SequenceState]) -> SequenceState:
    """One prompt's samples drawn in groups (states of batch 1, any samples each) as one state of batch 1 whose
    samples are all of theirs, in order (``continuum.loop.turns``)."""
    if len(states) == 1:
        return states[0]
    assert all(s.batch == 1 for s in states)
    rows = [s if s.samples == 1 else SequenceState(model=s._model, ids=s._ids, mask=s._mask, logprobs=s._logprobs,
                                                    weights=s._weights, kv=s._kv, batch=s.samples, samples=1,
                                                    last=s._last) for s in states]
    out = stack(rows)
    return SequenceState(model=out._model, ids=out._ids, mask=out._mask, logprobs=out._logprobs, weights=out._weights,
                         kv=out._kv, batch=1, samples=out.batch, last=out._last)


def stack(states: Sequence[SequenceState]) -> SequenceState:
    """Stack states along the batch axis (same tokenizer and samples), keeping their caches.

    Each state's cached columns are left-padded to the widest cache and its uncached suffix to
    the widest suffix, so every row keeps its cache and positions.
    """
    states = list(states)
    if not states:
        raise BatchMismatch("cannot stack an empty list of states")
    bad = [type(s).__name__ for s in states if not isinstance(s, SequenceState)]
    if bad:
        raise ContinuumTypeError(f"stack takes a list of SequenceStates, got a {bad[0]}: make prompts into states with "
                                 f"SequenceState.from_prompts(model, prompts)")
    first = states[0]
    if len(states) == 1:
        return first
    rejoined = deferred.rejoin(states)  # (every caller of one joint call, in its order: that call's rows, once)
    if rejoined is not None:
        return rejoined
    for s in states[1:]:
        if s.samples != first.samples:
            raise SampleMismatch(f"cannot stack states with samples={first.samples} and samples={s.samples}: "
                                 f"select the same number of samples from each, e.g. state[:, :1, :]")
        check_same_model(first, s, "stack")
    states = convert.to_model_all(states, first._model)  # the same model: only a changed dtype/device converts
    widths = [(kvcache.length(s._kv), s._ids.shape[1] - kvcache.length(s._kv)) for s in states]
    C, S = max(c for c, _ in widths), max(w for _, w in widths)
    ids, mask, lp = stacking.tokens(states, widths, C, S, first._model.tokenizer.pad_token_id)
    kv = None
    if C and kvcache.opaque(next(s._kv for s in states if s._kv is not None)):
        kv = kvcache.stack_rows([_handle_of(s, states) for s in states], C)
    elif C:  # new storage: each state's cached columns right-aligned at C, zeros before (masked, never NaN)
        kv = kvcache.from_tensors(first._model, stacking.kv_layers(states, widths, C))
    weights = torch.cat([s._weights for s in states])
    last = None
    lasts = [s._last for s in states if s._last is not None]
    if len(lasts) == len(states) and len({x.kind for x in lasts}) == 1:
        def joined(name: str):  # a per-row field, kept when every state has it
            parts = [getattr(x, name) for x in lasts if getattr(x, name)]
            return sum(parts, ()) if len(parts) == len(lasts) else None

        last = replace(lasts[0], starts=sum((x.starts for x in lasts), ()), ends=sum((x.ends for x in lasts), ()),
                               complete=sum((x.complete for x in lasts), ()), finish=joined("finish"),
                               marks=joined("marks"), guide_states=joined("guide_states"), thoughts=joined("thoughts"))
    out = SequenceState(model=first._model, ids=ids, mask=mask, logprobs=lp, weights=weights, kv=kv,
                        batch=sum(s.batch for s in states), samples=first.samples, last=last)
    for key in VIEWS:  # (each row's real tokens, text and cached count are its state's, where they were known: a
        if all(key in s._cache for s in states):  # joint call's callers not read back again)
            out._cache[key] = [row for s in states for row in s._cache[key]]
    return out


def _handle_of(state: SequenceState, states: list[SequenceState]) -> kvcache.KV:
    """``state``'s KV handle; for a state with none, its rows of another's with every column cut (no cells)."""
    if state._kv is not None:
        return state._kv
    ref = next(s._kv for s in states if s._kv is not None)
    rows = kvcache.select_rows(ref, torch.zeros(state.rows, dtype=torch.long))
    return kvcache.keep(rows, torch.zeros((state.rows, kvcache.length(ref)), dtype=torch.bool))
