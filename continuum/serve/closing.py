"""A tool call whose ``max_tokens`` fits its shortest valid form is never cut: it is steered to close.

Without this, a call the budget cuts is lost (``finish_reason: "length"``, no call). The guide
below wraps an outlines-core guide (an automaton over tokens) and counts the tokens left: from the
automaton's transitions it knows, for every state, the fewest tokens that reach an accepting state
(a reverse breadth-first search, once per guide). While the budget is loose it changes nothing; when
it gets tight, tokens after which the call could no longer close in the tokens left are masked,
so the call ends in time (shorter arguments, an enum's shortest value, a closing brace). A budget
below the shortest call still gets the shortest way out (best effort), and is then cut as before.
llguidance guides expose no automaton, so calls compiled by llguidance are not steered.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from ..guides.outlines import OutlinesGuide

__all__ = ["ClosingGuide", "closing"]

_LOCK = threading.Lock()


def _distances(inner: OutlinesGuide) -> tuple[dict[int, dict[int, int]], dict[int, int]]:
    """The automaton's transitions and, per state, the fewest tokens to an accepting state (cached on the guide)."""
    with _LOCK:
        hit = inner.__dict__.get("_closing")
        if hit is not None:
            return hit
    transitions: dict[int, dict[int, int]] = {int(s): dict(e) for s, e in inner.index.get_transitions().items()}
    back: dict[int, set[int]] = {}
    for s, edges in transitions.items():
        for n in set(edges.values()):
            back.setdefault(n, set()).add(s)
    dist = {s: 0 for s in inner._final}
    queue = deque(dist)
    while queue:
        n = queue.popleft()
        for s in back.get(n, ()):
            if s not in dist:
                dist[s] = dist[n] + 1
                queue.append(s)
    with _LOCK:
        inner.__dict__["_closing"] = (transitions, dist)
    return transitions, dist


class ClosingGuide:
    """``inner`` with a budget of ``budget`` tokens: states are ``(inner state, tokens left)``."""

    copy_free = True

    def __init__(self, inner: OutlinesGuide, budget: int):
        self.inner, self.budget = inner, budget
        self.key = f"{inner.key}|closing:{budget}"
        self._transitions, self._dist = _distances(inner)
        self._masked: dict[tuple[int, int], torch.Tensor | None] = {}

    def new_state(self) -> Any:
        return (self.inner.new_state(), self.budget)

    def _over(self, state: int, room: int) -> torch.Tensor | None:
        """Token ids after which ``state`` cannot close within ``room`` more tokens (None: none)."""
        key = (state, room)
        if key not in self._masked:
            far = 1 << 30
            edges = self._transitions.get(state, {})
            need = {t: self._dist.get(n, far) for t, n in edges.items()}
            fits = room if any(d <= room for d in need.values()) else min(need.values(), default=far)
            bad = [t for t, d in need.items() if d > fits]  # (too small a budget: the shortest way out still)
            self._masked[key] = torch.tensor(bad, dtype=torch.long) if bad else None
        return self._masked[key]

    def apply_mask(self, logprobs: torch.Tensor, states: Sequence[Any]) -> torch.Tensor:
        out = self.inner.apply_mask(logprobs, [None if s is None else s[0] for s in states])
        for r, s in enumerate(states):
            if s is not None and s[0] is not None:
                bad = self._over(s[0], s[1] - 1)
                if bad is not None:
                    out[r, bad.to(out.device)] = float("-inf")
        return out

    def advance(self, state: Any, token_id: int) -> Any:
        if state is None:
            return None
        nxt = self.inner.advance(state[0], token_id)
        return None if nxt is None else (nxt, state[1] - 1)

    def is_final(self, state: Any) -> bool:
        return state is not None and self.inner.is_final(state[0])

    def is_done(self, state: Any) -> bool:
        return state is not None and self.inner.is_done(state[0])

    def copy(self, state: Any) -> Any:
        return state

    def forced_tokens(self, state: Any) -> list[int]:
        return [] if state is None else self.inner.forced_tokens(state[0])


def closing(gen, budget: int | None):
    """``gen`` (a JSON generator) steered to close within ``budget`` tokens; ``gen`` itself when there is no
    budget or its guide is not an outlines-core automaton."""
    from ..generate import Generator

    if budget is None or not isinstance(gen.guide, OutlinesGuide):
        return gen
    out = Generator(gen.model, gen.sampler, ClosingGuide(gen.guide, budget), kind=gen.kind, parse=gen.parse,
                    description=gen.description, guidance=gen.guidance, fast_forward=gen.fast_forward,
                    token_healing=gen.token_healing)
    for name in ("exact", "not_enforced"):
        if hasattr(gen, name):
            setattr(out, name, getattr(gen, name))
    return out
