"""``ReasoningGuide``: a free thought, then the inner constraint (a reasoning row is a phase of a row).

It wraps any guide (or none: free text) so the decoding loop needs nothing new. A row's state is
``(phase, pos, thought, inner)``:

* ``open``: the start marker and the newline the template writes after it are forced (``pos`` walks them);
* ``think``: no mask but the end-of-sequence ids (a thought must end before the answer) and a single-id
  start marker (no nested thought): the sampler's
  own distribution, and the log-probs recorded are the model's. ``pos`` counts how much of the end
  marker the last tokens matched (markers detected by TOKEN ID, never by decoded text); ``thought``
  counts thought tokens; the last slot says whether the last one ended a line. At ``budget`` the
  template's closing is forced: a newline (unless the thought ends one), then the end marker;
* ``sep``: the newlines the template writes after the end marker (forced);
* ``answer``: the inner guide from its initial state; the budget never applies here.

Example:
    >>> g = ReasoningGuide(json_guide, markers, budget=16)     # doctest: +SKIP
    >>> s = g.new_state()                                     # Row("open", 0, 0)
    >>> g.forced_tokens(s)                                    # doctest: +SKIP
    [151667, 198]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .base import DEAD, Guide

__all__ = ["Markers", "ReasoningGuide", "Row", "OPEN", "THINK", "SEP", "ANSWER"]

OPEN, THINK, SEP, ANSWER = "open", "think", "sep", "answer"


@dataclass(frozen=True)
class Markers:
    """Reasoning markers as token ids (one id each for special tokens), and the template's newlines."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    open_sep: tuple[int, ...] = ()   # written after the start marker ("\n" for Qwen3 / DeepSeek-R1)
    close_sep: tuple[int, ...] = ()  # written after the end marker ("\n\n")
    newline: int | None = None       # the "\n" token, written before a forced end marker (templates close "\n</think>")
    line_ends: frozenset = frozenset()  # the tokens whose text ends with "\n"
    start_text: str = "<think>"
    end_text: str = "</think>"

    @property
    def overhead(self) -> int:
        """Tokens a thought adds around its text: both markers and their newlines."""
        return len(self.start) + len(self.open_sep) + len(self.end) + len(self.close_sep)


class Row:
    """A row's state: the phase tuple, in a holder that :meth:`ReasoningGuide.advance` updates in place,
    so the holders the last mask saw tell a stream each row's phase after the step (``phases``)."""

    __slots__ = ("s",)

    def __init__(self, s: tuple):
        self.s = s

    def __repr__(self) -> str:
        return f"Row{self.s[:3]}"


class ReasoningGuide:
    """A thought (unconstrained, ``budget`` tokens at most), then ``inner`` (module docstring).

    ``initial``: the phase a new row starts in (the prompt decides: see ``continuum.generate.reasoning``).
    ``stop_after``: end the row when the answer starts (choice by scoring scores the options next).
    """

    def __init__(self, inner: Guide | None, markers: Markers, budget: int | None, *, initial: tuple = (OPEN, 0),
                 eos: Sequence[int] = (), stop_after: bool = False):
        self.inner, self.markers, self.budget, self.stop_after = inner, markers, budget, stop_after
        self.initial, self.eos = initial, sorted(set(eos))
        self._open = markers.start + markers.open_sep
        self.copy_free = False  # (states are updated in place: see Row)
        self._seen: list = []  # the row holders the last mask saw (read by `phases`)
        inner_key = "stop" if stop_after else (inner.key if inner is not None else "text")
        self.key = f"reasoning({markers.start},{markers.end},{budget})+{inner_key}"

    # ------------------------------------------------------------------ protocol
    def new_state(self) -> Row:
        phase, pos = self.initial
        if phase == THINK:  # (pos: whether the prompt's last token ended a line)
            return Row((THINK, 0, 0, bool(pos)))
        return Row(self._enter(phase, pos, 0))

    def phases(self) -> list[str | None]:
        """Per row of the last mask, its phase now (after the tokens accepted since): what a stream reads."""
        return [r.s[0] if r is not None else None for r in self._seen]

    def _enter(self, phase: str, pos: int, thought: int) -> tuple:
        """The state at ``phase``, skipping empty forced sequences."""
        if phase == OPEN and pos >= len(self._open):
            return (THINK, 0, thought, True)  # (the opening ends a line: a budget of 0 closes at once)
        if phase == SEP and pos >= len(self.markers.close_sep):
            phase, pos = ANSWER, 0
        inner = self.inner.new_state() if phase == ANSWER and self.inner is not None and not self.stop_after else None
        return (phase, pos, thought, inner)  # (in the thought the last slot is the ends-a-line flag)

    def _only(self, state: tuple) -> int | None:
        """The one token the phase allows, or None when the next token is a real choice."""
        phase, pos, thought, _ = state
        if phase == OPEN:
            return self._open[pos]
        if phase == SEP:
            return self.markers.close_sep[pos]
        if phase == THINK and self.budget is not None and thought >= self.budget:
            nl = self.markers.newline
            return nl if pos == 0 and nl is not None and not state[3] else self.markers.end[pos]
        return None

    def advance(self, state: Row, token_id: int) -> Any:
        nxt = self._advance(state.s, token_id)
        if nxt is DEAD:
            return DEAD
        state.s = nxt
        return state

    def _advance(self, state: tuple, token_id: int) -> Any:
        phase, pos, thought, inner = state
        if phase == ANSWER:
            if self.inner is None or self.stop_after:
                return state
            nxt = self.inner.advance(inner, token_id)
            return DEAD if nxt is DEAD else (ANSWER, 0, thought, nxt)
        only = self._only(state)
        if only is not None and token_id != only:
            return DEAD
        if phase == OPEN:
            return self._enter(OPEN, pos + 1, 0)
        if phase == SEP:
            return self._enter(SEP, pos + 1, thought)
        end = self.markers.end
        if token_id == end[pos]:  # (part of) the end marker
            return self._enter(SEP, 0, thought) if pos + 1 == len(end) else (THINK, pos + 1, thought, False)
        if token_id in self.eos:
            return DEAD
        line = token_id in self.markers.line_ends
        if only is not None:  # the forced newline closing a thought cut by the budget: not a thought token
            return (THINK, 0, thought, True)
        # a thought token; a broken partial match of a multi-token marker may restart the match here
        return (THINK, 1 if token_id == end[0] and len(end) > 1 else 0, thought + 1, line)

    def is_final(self, state: Any) -> bool:
        if state is None or state.s[0] != ANSWER:
            return False
        return self.inner is None or self.stop_after or self.inner.is_final(state.s[3])

    def is_done(self, state: Any) -> bool:
        if state is None or state.s[0] != ANSWER:
            return False
        return self.stop_after or (self.inner is not None and self.inner.is_done(state.s[3]))

    def copy(self, state: Any) -> Any:
        if state is None:
            return None
        t = state.s
        if t[0] != ANSWER or t[3] is None or self.inner is None or self.inner.copy_free:
            return Row(t)
        return Row((*t[:3], self.inner.copy(t[3])))

    def forced_tokens(self, state: Any) -> list[int]:
        out: list[int] = []
        s = state.s
        while s is not DEAD and s[0] != ANSWER and len(out) < 256:
            t = self._only(s)
            if t is None:
                return out
            out.append(t)
            s = self._advance(s, t)  # (phases before the answer hold no inner state: nothing is mutated)
        if s is not DEAD and self.inner is not None and not self.stop_after:
            out += self.inner.forced_tokens(s[3])  # (does not consume: a fresh state or the row's, unchanged)
        return out

    def apply_mask(self, logprobs: torch.Tensor, rows: Sequence[Any]) -> torch.Tensor:
        self._seen = list(rows)
        states = [r.s if r is not None else None for r in rows]
        if self.inner is not None and not self.stop_after:
            inner = [s[3] if s is not None and s[0] == ANSWER else None for s in states]
            if any(x is not None for x in inner):
                logprobs = self.inner.apply_mask(logprobs, inner)
        forced_rows, forced_ids, think_rows = [], [], []
        for r, s in enumerate(states):
            if s is None or s[0] == ANSWER:
                continue
            only = self._only(s)
            if only is not None:
                forced_rows.append(r)
                forced_ids.append(only)
            elif self.eos:
                think_rows.append(r)
        if not forced_rows and not think_rows:
            return logprobs
        logprobs = logprobs.clone()  # (the loop may still read the unmasked tensor)
        dev = logprobs.device
        if think_rows:  # a thought cannot end the row: the answer must follow
            idx = torch.tensor(think_rows, device=dev)[:, None]
            logprobs[idx, torch.tensor(self.eos, device=dev)[None, :]] = float("-inf")
        if forced_rows:
            rows_t, ids_t = torch.tensor(forced_rows, device=dev), torch.tensor(forced_ids, device=dev)
            keep = logprobs[rows_t, ids_t].clone()
            logprobs[rows_t] = float("-inf")
            logprobs[rows_t, ids_t] = keep
        return logprobs
