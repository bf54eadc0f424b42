"""Indexing a state: ``state[batch, sample, chars]`` with its shorthands, and cutting text.

Cutting from the start (``state[..., :n]``) keeps the cache of the longest token prefix inside the
kept text (:func:`truncate`); any other cut re-tokenizes the kept text as a fresh prompt
(:func:`resegment`), except in rows cut from their own start, which keep their tokens as a lone row would.
Weights keep the log-probs of the generated tokens that lie wholly inside.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import SlicingError
from ..loop.arrivals import gated
from .combine import first_text
from .core import _NAN, SequenceState
from .text import byte_token_prefix, longest_token_prefix, token_char_spans

__all__ = ["getitem", "slice_chars", "truncate", "resegment"]


@gated
def getitem(state: SequenceState, key) -> SequenceState | str | list[str]:
    """``state[key]``: select batch/sample rows and cut text (see :class:`SequenceState`)."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is Ellipsis for k in key):  # numpy-style: `...` stands for the missing leading axes
        at = key.index(Ellipsis)
        if key.count(Ellipsis) > 1 or len(key) > 3:
            raise SlicingError("a state index holds at most one `...` and three positions: state[batch, sample, chars]")
        key = key[:at] + (slice(None),) * (4 - len(key)) + key[at + 1:]
    forms = {3: "state[batch, sample, chars]"}
    if state.batch == 1 and state.samples == 1:
        forms[1] = "state[chars]"
    elif state.batch == 1:
        forms[2] = "state[sample, chars]"
    elif state.samples == 1:
        forms[2] = "state[batch, chars]"
    if len(key) not in forms:
        raise SlicingError(
            f"a state of shape (batch={state.batch}, samples={state.samples}) takes "
            + " or ".join(sorted(set(forms.values()), key=len))
            + f" (or state[..., chars] for any shape); got {len(key)} index(es)")
    if len(key) == 3:
        bkey, skey, ckey = key
    elif len(key) == 1:
        bkey, skey, ckey = 0, 0, key[0]
    elif state.batch == 1:
        bkey, skey, ckey = 0, key[0], key[1]
    else:
        bkey, skey, ckey = key[0], 0, key[1]
    bsel = _axis(bkey, state.batch, "batch")
    ssel = _axis(skey, state.samples, "sample")
    rows = [b * state.samples + s for b in bsel for s in ssel]
    picked = state if rows == list(range(state.rows)) else state._select(rows, len(bsel), len(ssel))
    if isinstance(ckey, int):
        texts = picked.texts
        try:
            chars = [t[ckey] for t in texts]
        except IndexError:
            raise SlicingError(f"character index {ckey} out of range for row texts of lengths {[len(t) for t in texts]}: "
                               f"use an index inside every row, or a slice (slices clip)") from None
        return chars[0] if len(chars) == 1 else chars
    if not isinstance(ckey, slice):
        raise SlicingError(f"the chars index must be an int or a slice (e.g. state[..., :40]), got {type(ckey).__name__}")
    if ckey.step not in (None, 1):
        raise SlicingError(f"the chars slice must have step 1 (got {ckey.step}): a state's text cannot be cut with gaps; "
                           f"slice with step 1, or slice the text itself (str(state)[::2])")
    return slice_chars(picked, ckey.start, ckey.stop)

def slice_chars(state: SequenceState, start: int | None, stop: int | None) -> SequenceState:
    texts = state.texts
    bounds = [slice(start, stop).indices(len(t))[:2] for t in texts]
    if all(s == 0 for s, _ in bounds):
        if all(e >= len(t) for (_, e), t in zip(bounds, texts)):
            return state
        return truncate(state, [max(e, 0) for _, e in bounds])
    return resegment(state, bounds)

def truncate(state: SequenceState, ends: Sequence[int]) -> SequenceState:
    """Keep the first ``ends[r]`` characters of each row, reusing the cache of what stays."""
    texts, real, cached = state.texts, state._real_rows(), state._cached_real()
    tok = state._model.tokenizer
    keep, tails, weights = [], [], []
    for r in range(state.rows):
        ids, lps = real[r]
        k, leftover, weight = _from_start(tok, ids, lps, texts[r], ends[r], float(state._weights[r]))
        c = min(k, cached[r])
        keep.append(c)
        tails.append((ids[c:k] + leftover, lps[c:k] + [_NAN] * len(leftover)))
        weights.append(weight)
    last = None
    if state._last is not None:
        ends_ = tuple(min(e, ends[r]) for r, e in enumerate(state._last.ends))
        starts = tuple(min(s, ends[r]) for r, s in enumerate(state._last.starts))
        complete = tuple(c and e <= ends[r] for r, (c, e) in enumerate(zip(state._last.complete, state._last.ends)))
        last = state._last.edited(starts=starts, ends=ends_, complete=complete)
    return state._rebuild(keep, tails, torch.tensor(weights, dtype=state._weights.dtype), last)


def _from_start(tok, ids: list[int], lps: list[float], text: str, end: int, weight: float) -> tuple[int, list[int], float]:
    """A row cut to ``text[:end]``: ``(k, leftover, weight)``, its first ``k`` tokens kept, ``leftover`` tokens completing
    the cut, and its weight: carried whole by an uncut row, else the log-probs of the tokens kept."""
    if end >= len(text):
        return len(ids), [], weight
    k, leftover = _prefix_tokens(tok, ids, text[:end])
    return k, leftover, math.fsum(x for x in lps[:k] if x == x)


def _prefix_tokens(tok, ids: list[int], target: str) -> tuple[int, list[int]]:
    """``(k, leftover)``: the row's first ``k`` tokens lie inside ``target`` (a prefix of its text), and ``leftover``
    tokens complete it (a character split across tokens, or the text after the last whole token)."""
    k, n = longest_token_prefix(tok, ids, target)
    split = byte_token_prefix(tok, ids, target) if n < len(target) else None  # (a cut at a token's end: no split)
    if split is not None and split[0] > k:  # the cut ends inside a character split across tokens
        k, leftover = split
    else:
        leftover = tok.encode_continuation(target[n:])
    if leftover and tok.decode(ids[:k] + leftover) != target:
        # the re-encoded text merged with a kept dangling byte token: back off a few tokens
        for k2 in range(k - 1, max(-1, k - 9), -1):
            prefix = tok.decode(ids[:k2])
            rest = tok.encode_continuation(target[len(prefix):]) if target.startswith(prefix) else None
            if rest is not None and tok.decode(ids[:k2] + rest) == target:
                return k2, rest
    return k, leftover


def resegment(state: SequenceState, bounds: Sequence[tuple[int, int]]) -> SequenceState:
    """Cut ``text[start:stop]`` per row, as fresh prompts (no cache): a row cut from its start keeps its tokens as
    :func:`truncate` keeps them (what another row's cut needs never changes this row's tokens or weight); any
    other row is its kept text re-tokenized."""
    tok = state._model.tokenizer
    texts, real = state.texts, state._real_rows()
    kept: dict[int, tuple[list[int], list[float]]] = {}  # each row's tokens and their log-probs
    new_texts, weights = [], []
    for r, (s, e) in enumerate(bounds):
        ids, lps = real[r]
        new_texts.append(texts[r][s:max(e, s)])
        if s == 0:  # (as truncate cuts it)
            k, leftover, weight = _from_start(tok, ids, lps, texts[r], e, float(state._weights[r]))
            kept[r] = (ids[:k] + leftover, lps[:k] + [_NAN] * len(leftover))
            weights.append(weight)
        else:
            spans = token_char_spans(tok, ids)
            weights.append(math.fsum(p for p, (a, b) in zip(lps, spans) if p == p and a >= s and b <= max(e, s) and b > a))
    fresh = [r for r in range(state.rows) if r not in kept]
    for r, ids in zip(fresh, tok.encode_prompts([new_texts[r] for r in fresh]) if fresh else []):
        row = _kept_text(tok, ids, new_texts[r])
        kept[r] = (row, [_NAN] * len(row))
    rows, lp_rows = [kept[r][0] for r in range(state.rows)], [kept[r][1] for r in range(state.rows)]
    last = None
    if state._last is not None:
        clip = lambda x, r: min(max(x - bounds[r][0], 0), len(new_texts[r]))  # noqa: E731
        last = state._last.edited(starts=tuple(clip(x, r) for r, x in enumerate(state._last.starts)),
                       ends=tuple(clip(x, r) for r, x in enumerate(state._last.ends)),
                       complete=tuple(c and state._last.ends[r] <= bounds[r][1] for r, c in enumerate(state._last.complete)),
                       marks=_rebase_marks(state._last, bounds))
    return SequenceState._from_rows(state._model, rows, lp_rows, torch.tensor(weights, dtype=state._weights.dtype),
                                    state.batch, state.samples, last)


def _kept_text(tok, ids: list[int], text: str) -> list[int]:
    """A cut's prompt tokens, read back as the cut's text. A SentencePiece prompt drops the first leading space
    of its text (``" cd"`` encodes as ``<s> ▁cd``, read ``"cd"``): the text is then appended to the prompt's
    special tokens as a row's first text is (:func:`~continuum.state.combine.first_text`)."""
    if not text or tok.decode(ids) == text:
        return ids
    special = []
    for i in ids:
        if i not in tok.special_ids:
            break
        special.append(i)
    rest = first_text(tok, special, tok.encode_continuation(text), text)
    return special + rest if tok.decode(special + rest) == text else ids


def _rebase_marks(last, bounds: Sequence[tuple[int, int]]):
    """``LastStep.marks`` (relative to the step's start) after cutting ``text[start:stop]``: a cut
    inside the step moves its start to 0, so its marks move back by what was cut of the step."""
    if last.marks is None:
        return None
    return tuple(tuple((a - max(b0 - s, 0), b - max(b0 - s, 0), k) for a, b, k in row)
                 for row, s, (b0, _) in zip(last.marks, last.starts, bounds))


def _axis(key, size: int, name: str) -> list[int]:
    if isinstance(key, bool):
        raise SlicingError(f"{name} index must be an int, a slice or a list of ints, got bool")
    if isinstance(key, int):
        if not -size <= key < size:
            raise SlicingError(f"{name} index {key} out of range for {size} {name} row(s): use -{size}..{size - 1}")
        return [key % size]
    if isinstance(key, slice):
        sel = list(range(size))[key]
        if not sel:
            raise SlicingError(f"the {name} slice {key} selects no rows (size {size}): select at least one")
        return sel
    if isinstance(key, (list, tuple)) and all(isinstance(k, int) for k in key):
        if not key:
            raise SlicingError(f"empty {name} selection: select at least one row")
        return [k for item in key for k in _axis(item, size, name)]
    raise SlicingError(f"{name} index must be an int, a slice or a list of ints, got {type(key).__name__}")
