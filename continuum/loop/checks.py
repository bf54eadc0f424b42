"""The checks of a decoding call's arguments and input: ``max_tokens``, ``rng``, ``stop_at``, the samples of
the state and the room the context leaves (each a continuum error that says what to do)."""

from __future__ import annotations

import torch

from ..errors import ContextLengthError, ContinuumTypeError, GeneratorArgumentError, SampleMismatch
from ..models.memory import check_rows_fit
from ..models.tokenizer import check_encodable
from ..samplers import Sampler
from ..state import SequenceState
from ..state.text import token_char_spans

__all__ = ["check_max_tokens", "check_rng", "check_continuable", "check_lengths", "stop_list", "engine_setting"]

# columns for generated tokens a loop's buffers (Rows, classifier-free guidance's branch) allocate up front; they
# grow the rest as the call goes on (max_tokens=None on an unbounded context would be 2**31 columns)
PREALLOCATED = 256


def check_max_tokens(max_tokens: int | None) -> None:
    if max_tokens is None:
        return
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise GeneratorArgumentError(f"max_tokens must be an int or None, got {type(max_tokens).__name__}")
    if max_tokens < 0:
        raise GeneratorArgumentError(f"max_tokens must be >= 0 (0 = prefill only), got {max_tokens}")


def check_rng(rng) -> None:
    """``rng`` must be a ``torch.Generator`` or None (torch's own error names no argument)."""
    if rng is not None and not isinstance(rng, torch.Generator):
        raise ContinuumTypeError(f"rng must be a torch.Generator (e.g. torch.Generator().manual_seed(0)) or None, "
                                 f"got {type(rng).__name__}")


def stop_list(stop_at) -> list[str]:
    if stop_at is None:
        return []
    if not isinstance(stop_at, (str, list, tuple)):
        raise GeneratorArgumentError(f"stop_at must be a string or a list of strings (e.g. '.' or ['.', '\\n']), "
                                     f"got {type(stop_at).__name__}")
    stops = [stop_at] if isinstance(stop_at, str) else list(stop_at)
    if not all(isinstance(s, str) and s for s in stops):
        raise GeneratorArgumentError(f"stop_at must be a non-empty string or a list of them (e.g. '.' or ['.', '\\n']), "
                                     f"got {stop_at!r}: an empty stop string would stop before the first token")
    check_encodable(stops if isinstance(stop_at, (list, tuple)) else stop_at, "stop_at")
    return stops


def check_continuable(state: SequenceState, sampler: Sampler, max_tokens: int | None) -> int:
    """Validate ``state`` for ``sampler``; return how many tokens may be generated (context-capped)."""
    group, n = state.samples, sampler.samples
    if group not in (1, n):
        kind = "samplers.beam_search" if sampler.is_beam_search else "samplers.multinomial"
        raise SampleMismatch(
            f"this state has {group} samples per batch row but the generator produces {n}: use a generator with "
            f"{kind}({group}), or select one sample first (state[:, i, :]) and let the generator fork it")
    lengths = check_lengths(state)
    ctx = state._model.context_length
    if ctx is None:
        steps = max_tokens if max_tokens is not None else 2**31
    else:
        room = ctx - min(lengths)  # the loop stops every row at its own limit
        steps = room if max_tokens is None else min(max_tokens, room)
    if n > group:  # a fork: the new rows must fit in memory (a kernel OOM kill is no error message)
        check_rows_fit(state._model, state.batch, n, max(lengths) + min(steps, 2**20), state._model.device)
    return steps


def check_lengths(state: SequenceState) -> list[int]:
    """Every row holds a token and fits the model's context; returns the rows' lengths. (A call run in parts checks
    this on all its rows before any part starts: a bad row fails the call at once, not after the parts before it.)"""
    lengths = state._mask.sum(1).tolist()  # (as a list: one tensor op, where min/max/any were one each, per call)
    if 0 in lengths:
        rows = [r for r, n in enumerate(lengths) if n == 0]
        raise GeneratorArgumentError(f"row(s) {rows} hold no token: give a non-empty prompt (this tokenizer adds no BOS token)")
    ctx = state._model.context_length
    if ctx is not None and max(lengths) > ctx:
        raise ContextLengthError(_too_long(state, ctx))
    return lengths


def _too_long(state: SequenceState, ctx: int) -> str:
    """The message for an input longer than the context, with a cut that leaves half of it to generate."""
    keep, tok = ctx // 2, state._model.tokenizer
    long = [(ids, t) for (ids, _), t in zip(state._real_rows(), state.texts) if len(ids) > keep]
    chars = max(1, min(len(t) - token_char_spans(tok, ids)[-keep][0] for ids, t in long))
    worst = max(len(ids) for ids, _ in long)
    return (f"the input has {worst} tokens but the model's context is {ctx}: keep only its end, e.g. "
            f"state[..., -{chars}:] (or prompt[-{chars}:]) keeps about {keep} tokens of every row")


def checked_setting(name: str, value, allow_none: bool):
    """``value`` if it is a positive int (or None where allowed), else a continuum error naming the setting."""
    ok = value is None if allow_none else False
    ok = ok or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
    if not ok:
        raise GeneratorArgumentError(f"model.engine.{name} must be a positive int{' or None' if allow_none else ''}, "
                                     f"got {value!r}")
    return value


def engine_setting(name: str, allow_none: bool) -> property:
    """A setting of ``model.engine`` (``max_rows``, ``max_kv_bytes``, ``prefill_chunk``) checked when it is set: a
    positive int (or None where allowed), else a continuum error naming it (never a raw error inside a step)."""
    attr = "_" + name

    def get(self):
        return getattr(self, attr)

    def set_(self, value) -> None:
        setattr(self, attr, checked_setting(name, value, allow_none))

    return property(get, set_, doc=f"``{name}``: see :class:`Engine` (checked when set).")
