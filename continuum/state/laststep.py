"""``LastStep``: where the last generation step's output lies in each row's text, and how it ended."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["LastStep"]


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
        def pick(t: Any) -> Any:  # any per-row tuple field, or None
            return tuple(t[r] for r in rows) if t is not None else None

        return replace(self, starts=pick(self.starts), ends=pick(self.ends), complete=pick(self.complete),
                       guide_states=pick(self.guide_states), finish=pick(self.finish), marks=pick(self.marks),
                       thoughts=pick(self.thoughts))

    def edited(self, **changes) -> LastStep:
        """The same step after the text was edited: resumable guide states are dropped."""
        return replace(self, guide_states=None, **changes)
