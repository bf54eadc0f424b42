"""``LastStep``: where the last generation step's output lies in each row's text, and how it ended."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import IncompleteGenerationError, SchemaViolationError
from .completion import Completion

__all__ = ["LastStep", "read_values"]


@dataclass(frozen=True)
class LastStep:
    """Where the last generation step's output lies in each row's text (character offsets)."""

    kind: str  # "text", "choice", "regex" or "json"
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    complete: tuple[bool, ...]  # False: cut by max_tokens/context before the pattern matched
    parse: Callable[[str], Any] | None = None
    max_tokens: int | None = None
    # Where an unfinished constrained step stopped, so a guide with the same key (same constraint,
    # same engine) can resume it. Only valid while the row's text ends where the step ended: any
    # edit of the text drops them. States may be mutable engine objects (llguidance matchers): they
    # are never changed here, and resuming works on a copy (see rows.Rows).
    guide_key: str | None = None
    guide_states: tuple[Any, ...] | None = None
    # Why each row's step ended: "eos", "stop", "length" (max_tokens), "context", "pattern". Kept through edits.
    finish: tuple[str, ...] | None = None
    # Per row, the tokens of the step that the loop did not sample freely, as ``(start, end, kind)``
    # character spans RELATIVE TO ``starts[r]`` (so prepending text keeps them): kind ``"forced"``
    # (fast-forward, :mod:`continuum.loop.fastforward`) or ``"healed"`` (token healing: the first token,
    # which starts before the step, :mod:`continuum.loop.healing`). Read by :mod:`continuum.display`.
    marks: tuple[tuple[tuple[int, int, str], ...], ...] | None = None
    # Reasoning (continuum.generate.reasoning): per row ``(step start, thought start, thought end, thought tokens)``,
    # characters and the tokens spent thinking; ``starts`` is then where the answer begins.
    thoughts: tuple[tuple[int, int, int, int], ...] | None = None
    # Speculative decoding (continuum.speculate): the call's ``forwards`` (after the prefill), tokens ``drafted`` and
    # ``accepted``, for all its rows together; None without speculation.
    speculation: dict[str, int] | None = None

    def select(self, rows: Sequence[int]) -> LastStep:
        if isinstance(rows, range) and rows.step == 1:  # (a joint call's caller: its rows one after another)
            return self.spans([(rows.start, len(rows))])[0]

        def pick(t: Any) -> Any:  # any per-row tuple field, or None
            return tuple(t[r] for r in rows) if t is not None else None

        return self._with(**{name: pick(getattr(self, name)) for name in _ROW_FIELDS})

    def spans(self, spans: Sequence[tuple[int, int]]) -> list[LastStep]:
        """``[select(range(row, row + n)) for row, n in spans]``: a joint call's callers' steps, each field read once
        for all of them (~4 us a caller, where one ``select`` each took ~12)."""
        fields = [(name, t if t is None or type(t) is tuple else tuple(t)) for name in _ROW_FIELDS
                  for t in (getattr(self, name),)]
        out = []
        for row, n in spans:
            new = object.__new__(LastStep)
            new.__dict__.update(self.__dict__)
            new.__dict__.update({name: None if t is None else t[row:row + n] for name, t in fields})
            out.append(new)
        return out

    def edited(self, **changes) -> LastStep:
        """The same step after the text was edited: resumable guide states are dropped."""
        return self._with(guide_states=None, **changes)

    def _with(self, **changes) -> LastStep:
        """``dataclasses.replace`` without its keyword call of ``__init__`` (~10 us, once per caller of a joint call
        and per ``state + text``; nothing here validates fields). Only field names are accepted."""
        unknown = set(changes) - _FIELDS
        if unknown:
            raise TypeError(f"LastStep has no field {sorted(unknown)[0]!r}")
        new = object.__new__(LastStep)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new


_FIELDS = frozenset(LastStep.__dataclass_fields__)
_ROW_FIELDS = ("starts", "ends", "complete", "guide_states", "finish", "marks", "thoughts")  # (a value per row)


def read_values(state: Any, last: LastStep) -> list:
    """Every row's value of ``state``'s last step (``SequenceState.value`` before shaping): its text (text/regex),
    the option (choice) or the parsed JSON. Raises :class:`~continuum.errors.IncompleteGenerationError` naming the
    rows a constrained step left incomplete, :class:`~continuum.errors.SchemaViolationError` naming the row."""
    texts, samples = state.texts, state.samples
    out, bad = [], []
    for r, (s, e) in enumerate(zip(last.starts, last.ends)):
        text = texts[r][s:e]
        if last.kind != "text" and not last.complete[r]:
            bad.append(r)
        elif last.kind == "text" and last.finish is not None:
            out.append(Completion(text, last.finish[r]))
        else:
            out.append(_parse_row(last, r, samples, text))
    if bad:
        where = ", ".join(f"row {r} (batch {r // samples}, sample {r % samples})" for r in bad)
        if last.finish is not None and any(last.finish[r] == "context" for r in bad):
            why = (f"the model's context length ({state._model.context_length} tokens). Shorten the input, e.g. "
                   f"state[..., -N:] to keep its last N characters, and generate again.")
        else:
            why = (f"{'max_tokens=' + str(last.max_tokens) if last.max_tokens is not None else 'the context length'}. "
                   f"Raise max_tokens, or continue this state with the same generator (it resumes the pattern "
                   f"where it stopped).")
        raise IncompleteGenerationError(f"the {last.kind} output of {where} is incomplete: generation stopped before "
                                        f"the pattern was matched, at {why}", rows=bad, max_tokens=last.max_tokens)
    return out


def _parse_row(last: LastStep, r: int, samples: int, text: str) -> Any:
    """Row ``r``'s value; a schema violation is re-raised naming the row."""
    if not last.parse:
        return text
    try:
        return last.parse(text)
    except SchemaViolationError as exc:
        b, s = divmod(r, samples)
        raise SchemaViolationError(f"row {r} (batch {b}, sample {s}): {exc} -- the engine did not enforce this "
                                   f"rule; output: {text[:200]!r}", path=exc.path, rule=exc.rule, value=exc.value,
                                   row=r, batch=b, sample=s) from exc
