"""The native routes' states: a call's input rebuilt from stored states and the client's ids, and the answer's rows.

A client row either names a stored state, a row of it and how many of that row's tokens it keeps (the KV of those is
reused: only the ids after them are computed), or carries all its ids. Rows of one stored state are selected and cut
in one operation (``_select`` then ``_rebuild``: the state algebra's own, so the kept KV is the stored one); rows of
several stored states (a stacked batch) are rebuilt one by one and stacked.

The answer sends, per result row, the input row it grew from, how many of that row's tokens (ids and log-probs) it
kept, and the rest: a fork, a beam or a stop string cut keeps most of its input, token healing a little less.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import BatchMismatch, GeneratorArgumentError, RemoteStateError
from ..models.remote.wire import floats, nans
from ..state import SequenceState

__all__ = ["input_state", "answer_rows", "resumed"]


def _unknown(sid: str) -> RemoteStateError:
    # the same words for an unknown id and another key's: nobody learns whether an id exists (like responses)
    return RemoteStateError(f"this server has no stored state {sid!r} for your API key (unknown, deleted, expired, or "
                            f"another key's): model.detach(state) keeps the state's tokens, weights and log-probs "
                            f"without the handle, and the next call recomputes them here")


def input_state(model: Any, store: Any, owner: str, rows: list[Any], batch: int, samples: int,
                served: str | None = None) -> tuple[SequenceState, str | None, SequenceState | None]:
    """(the input state, the stored state every row extends or None, that state) from the request's rows."""
    if batch < 1 or samples < 1 or batch * samples != len(rows):
        raise BatchMismatch(f"{len(rows)} rows sent for batch={batch} x samples={samples}")
    vocab = model.vocab_size
    stored: dict[str, SequenceState] = {}
    for r, row in enumerate(rows):
        bad = next((t for t in row.ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise GeneratorArgumentError(f"row {r}: token id {bad} is not in the model's vocabulary (0..{vocab - 1})")
        if len(row.logprobs) != len(row.ids):
            raise GeneratorArgumentError(f"row {r}: {len(row.ids)} ids but {len(row.logprobs)} log-probs")
        if row.state is None:
            continue
        if row.state not in stored:
            record = store.get(row.state, owner)
            if record is not None and served is not None and record.body.get("model") not in (None, served):
                # (replicas of several models on one store: a handle is only good on a server of its own model)
                raise RemoteStateError(f"the stored state {row.state!r} was made by the model "
                                       f"{record.body.get('model')!r}; this server serves {served!r}. A state moves "
                                       f"to another model by its tokens: model.detach(state), or continue it on a "
                                       f"generator of the new model (its cache is recomputed there)")
            state = store.state(record) if record is not None and record.body.get("object") == "continuum.state" else None
            if state is None:
                raise _unknown(row.state)
            stored[row.state] = state
        _check_row(r, row, stored[row.state])
    weights = torch.tensor([row.weight for row in rows], dtype=torch.float32)
    if not stored:
        return SequenceState._from_rows(model, [row.ids for row in rows], [nans(row.logprobs) for row in rows], weights,
                                        batch, samples, None), None, None
    if len(stored) == 1 and all(row.state is not None for row in rows):
        sid, base = next(iter(stored.items()))
        return _extend(base, rows, weights, batch, samples), sid, base
    parts = [_extend(stored[row.state], [row], weights[r:r + 1], 1, 1) if row.state is not None else
             SequenceState._from_rows(model, [row.ids], [nans(row.logprobs)], weights[r:r + 1], 1, 1, None)
             for r, row in enumerate(rows)]
    joined = SequenceState.stack(parts) if len(parts) > 1 else parts[0]
    return SequenceState(model=joined._model, ids=joined._ids, mask=joined._mask, logprobs=joined._logprobs,
                         weights=joined._weights, kv=joined._kv, batch=batch, samples=samples), None, None


def _check_row(r: int, row: Any, base: SequenceState) -> None:
    if not 0 <= row.row < base.rows:
        raise RemoteStateError(f"row {r}: the stored state {row.state!r} has {base.rows} row(s), not a row {row.row}")
    ids = base._real_rows()[row.row][0]
    # (the stored state's tokens, not its KV: a backend whose KV the store does not keep, llama.cpp's, loads a stored
    # state with its tokens only, and the tokens the handle covers past the KV are recomputed: _extend)
    if not 0 < row.cached <= len(ids) or (row.check is not None and ids[row.cached - 1] != row.check):
        raise RemoteStateError(f"row {r}: the handle does not match the stored state {row.state!r} (row {row.row} "
                               f"has {len(ids)} tokens; the handle says {row.cached}): the state was changed outside "
                               f"the library; model.detach(state) sends its tokens instead")


def _extend(base: SequenceState, rows: list[Any], weights: torch.Tensor, batch: int, samples: int) -> SequenceState:
    """The rows of ``base`` that ``rows`` name, each keeping its first ``cached`` tokens' KV (those the stored state
    still has: a llama.cpp state loaded from the store has none, and they are recomputed), then its own ids."""
    picked = base._select([row.row for row in rows], batch, samples) if not _whole(base, rows, batch, samples) else base
    have, real = picked._cached_real(), picked._real_rows()
    keep = [min(row.cached, h) for row, h in zip(rows, have)]
    suffixes = [(ids[k:row.cached] + row.ids, lps[k:row.cached] + nans(row.logprobs))
                for (ids, lps), k, row in zip(real, keep, rows)]
    return picked._rebuild(keep, suffixes, weights, None)


def _whole(base: SequenceState, rows: list[Any], batch: int, samples: int) -> bool:
    """``rows`` name every row of ``base`` in order, in its shape, and no column is padding in all of them: selecting
    them would copy ``base`` (its KV included) to an equal state (a chain's call continuing its last answer)."""
    return (base.batch, base.samples) == (batch, samples) and [row.row for row in rows] == list(range(base.rows)) \
        and bool(base._mask.bool().any(0).all())


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _common(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> int:
    n = 0
    for ia, la, ib, lb in zip(a[0], a[1], b[0], b[1]):
        if ia != ib or not _same(la, lb):
            break
        n += 1
    return n


def answer_rows(inp: SequenceState, out: SequenceState) -> list[dict]:
    """Per result row: its source input row (the one of its batch row sharing the longest prefix), the tokens kept
    from it, the new ids and log-probs, the tokens the stored result covers, the weight."""
    src_real, real = inp._real_rows(), out._real_rows()
    cached, weights = out._cached_real(), out._weights.tolist()
    rows = []
    for i, row in enumerate(real):
        if out.batch == inp.batch:
            b = i // out.samples
            candidates = range(b * inp.samples, (b + 1) * inp.samples)
        else:  # (no generator changes the batch; if one did, any input row may be the source)
            candidates = range(inp.rows)
        source, keep = max(((s, _common(src_real[s], row)) for s in candidates), key=lambda c: c[1])
        rows.append({"source": source, "common": keep, "ids": row[0][keep:], "logprobs": floats(row[1][keep:]),
                     "cached": cached[i], "weight": weights[i]})
    return rows


def resumed(state: SequenceState, gen: Any, resume: dict) -> SequenceState:
    """``state`` resuming the unfinished constrained step of ``gen`` the client's state ended with (``resume``: that
    step's ``starts`` and ``complete`` per row): the guide's state of each unfinished row rebuilt by walking the
    guide over the row's tokens from the step's start, as a local call resumes with the guide states it kept. The
    guide's state itself does not travel (an engine's matcher is a live object)."""
    from ..state import LastStep

    starts, complete = list(resume.get("starts") or ()), list(resume.get("complete") or ())
    guide = gen.guide
    if guide is None or len(starts) != state.rows or len(complete) != state.rows:
        raise GeneratorArgumentError(f"resume: expected 'starts' and 'complete' for each of the {state.rows} rows of a "
                                     f"constrained generator")
    if gen.token_healing:  # (a healed first token begins before the step: its text is not the step's alone)
        raise GeneratorArgumentError("a remote model does not resume an unfinished step of a generator with "
                                     "token_healing yet: slice the state back to before the step and call again")
    tok = state._model.tokenizer
    states: list[Any] = []
    for r, (ids, _) in enumerate(state._real_rows()):
        if complete[r]:
            states.append(None)
            continue
        done, pending = tok.char_ends(ids)
        lengths = [d + p for d, p in zip(done, pending)]  # (the length of each prefix's text)
        k0 = next((k for k, n in enumerate(lengths) if n > starts[r]), len(ids))  # (the step's first token)
        if (lengths[k0 - 1] if k0 else 0) != starts[r]:
            raise GeneratorArgumentError(f"resume: row {r}'s step does not start at a token's start (character "
                                         f"{starts[r]}): slice the state back to before the step and call again")
        gs = guide.new_state()
        for t in ids[k0:]:
            gs = guide.advance(gs, t) if gs is not None else None
        if gs is None:  # (a token the constraint refuses: not this generator's step)
            raise GeneratorArgumentError(f"resume: row {r}'s step does not match this generator's constraint: slice "
                                         f"the state back to before the step and call again")
        states.append(gs)
    last = LastStep(kind=gen.kind, starts=tuple(starts), ends=tuple(len(t) for t in state.texts),
                    complete=tuple(bool(c) for c in complete), guide_key=guide.key, guide_states=tuple(states))
    return SequenceState(model=state._model, ids=state._ids, mask=state._mask, logprobs=state._logprobs,
                         weights=state._weights, kv=state._kv, batch=state.batch, samples=state.samples,
                         last=last)._memo_from(state)
