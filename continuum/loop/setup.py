"""A call's setup, in its caller's thread before the engine runs its loop: the argument checks, the KV it can reuse
(a backend's evicted windows recomputed, the prefix cache), its rows (:class:`~continuum.loop.rows.Rows`: every
per-row thing the loop carries), token healing's plans and classifier-free guidance's branch. A bad input raises here,
before anything is submitted. Also :func:`prefill` (cache all but each row's last token), used by choice scoring too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..guides import Guide
from ..models import kv as kvcache
from ..models.kv import positions
from ..samplers import Sampler
from ..speculate import Speculator, check_speculator
from ..state import SequenceState
from ..state.combine import lead_space
from .cfg import Guidance, UnconditionalBranch
from .checks import check_continuable, check_max_tokens, check_rng, stop_list
from .healing import heal
from .parallel import check_seeded
from .rows import Rows

__all__ = ["Setup", "setup", "prefill", "recompute_stale", "recompute_costly", "recompute_rows", "recompute_all"]


@dataclass
class Setup:
    """A call ready to run: its input (as the loop sees it), its rows, and how many steps it may take."""

    state: SequenceState
    rows: Rows
    steps: int
    exhausted: str  # why the last step ends: "length" (max_tokens) or "context"


def setup(state: SequenceState, sampler: Sampler, *, guide: Guide | None, max_tokens: int | None, stop_at,
          rng: torch.Generator | None, track_text: bool, guidance: Guidance | None, token_healing: bool,
          speculate: Speculator | None) -> Setup:
    """Check the call's arguments and build what its loop carries (see the module docstring)."""
    check_max_tokens(max_tokens)
    check_speculator(speculate, sampler, state._model)
    stops = stop_list(stop_at)
    check_rng(rng)
    steps = check_continuable(state, sampler, max_tokens)
    check_seeded(state._model, sampler, rng)  # under torchrun: every rank must draw the same tokens
    exhausted = "length" if max_tokens is not None and steps == max_tokens else "context"
    model = state._model
    state = recompute_stale(state)
    if guide is not None and steps > 0:  # a guided step at a row with no text yet reads as its guide walked it
        state = lead_space(state)
        steps = check_continuable(state, sampler, max_tokens)
    if steps == 0:  # prefill only: everything but the last token, which stays uncached
        state = prefill(state)
    elif getattr(model, "prefix_cache", None) is not None:  # the prefix cache extends rows' caches before the prefill
        state = model.prefix_cache.reuse(state, steps)
    rows = Rows(state, steps, guide, track_text or bool(stops), stops)
    if token_healing and steps > 0:
        state, heals = heal(state, guide, rows.guide_states or [None] * state.rows, rows.resumed)
        if any(h is not None for h in heals):
            rows = Rows(state, steps, guide, track_text or bool(stops), stops, heals)
    if guidance is not None and steps > 0:  # a fresh unconditional branch per call: negative prompt + this call's tokens
        rows.branch = UnconditionalBranch(guidance, state, steps)
        steps = rows.branch.steps  # capped where the unconditional rows reach the context
    return Setup(state, rows, steps, exhausted)


def prefill(state: SequenceState, reserve: int = 0) -> SequenceState:
    """Cache everything but each row's last token (one forward pass over the uncached suffix; the
    model's prefix cache, when on, supplies what it holds and keeps what was computed).
    ``reserve``: columns the caller appends right after (choice scoring's token tree), so the KV
    storage written here has room for them."""
    cache = getattr(state._model, "prefix_cache", None)  # (None: off; its methods are the same on every backend)
    try:  # (its forward joins the engine's next step while other calls run)
        return _prefill(state, reserve, cache)
    finally:
        if cache is not None:
            cache.settle()  # prefixes registered as being computed (in-batch sharing)


def recompute_stale(state: SequenceState) -> SequenceState:
    """``state`` with the cache of the rows the backend can no longer extend dropped, so this call computes them again
    from their tokens (llama.cpp: a sliding window's cells gone behind a restored state's end,
    ``models/llamacpp/window.py``): a state is never refused for what the backend evicted."""
    find = getattr(state._model, "stale_rows", None)
    return recompute_rows(state, set(find(state._kv)) if find is not None and state._kv is not None else set())


def recompute_costly(state: SequenceState, spilled: bool = False) -> SequenceState:
    """``state`` with the cache dropped of the rows whose cache takes more cells to bring back than their tokens to
    compute (llama.cpp: a short view of a long spilled state whose bytes cannot be cut, a hybrid's or a sliding
    window's, restores all of it): what a call refused for room tries next (``Generator._run_alone``); ``spilled``:
    of every row whose cache must be brought back (a fork family's members may restore apart where they were priced
    together: ``capacity.costly_rows``)."""
    find = getattr(state._model, "costly_rows", None)
    if find is None or state._kv is None:
        return state
    return recompute_rows(state, set(find(state._kv, spilled)))


def recompute_all(state: SequenceState) -> SequenceState:
    """``state`` with every row's cache dropped (``state`` itself when none is cached): what a call found stale
    again after its stale rows were recomputed tries last. A row computed from its tokens in the call is on a
    sequence of the call's own, which no other call extends, so none of its window cells can be given away behind
    its end meanwhile; a cached row whose view ends behind its sequence's end (another call extended that sequence
    in place, or a state held longer) may lose them to any concurrent call's decode at any step."""
    return recompute_rows(state, {r for r, c in enumerate(state._cached_real()) if c})


def recompute_rows(state: SequenceState, stale: set[int]) -> SequenceState:
    """``state`` with rows ``stale``'s cache dropped (computed again from their tokens by the next call)."""
    if not stale:
        return state
    keep = [0 if r in stale else c for r, c in enumerate(state._cached_real())]
    tails = [(ids[k:], lps[k:]) for (ids, lps), k in zip(state._real_rows(), keep)]
    return state._rebuild(keep, tails, state._weights, state._last)


def _prefill(state: SequenceState, reserve: int, cache) -> SequenceState:
    state = recompute_stale(state)
    if cache is not None:
        state = cache.reuse(state, reserve)  # (room after the uncached suffix, which it adds itself)
    C, W = kvcache.length(state._kv), state._ids.shape[1]
    if W - 1 <= C:
        return state
    mask = state._mask[:, :W - 1]
    _, kv = state._model.forward(state._ids[:, C:W - 1], mask, positions(mask)[:, C:], state._kv, logits="none",
                                 reserve=reserve)
    if cache is not None:
        cache.remember(state._model, state._ids, mask, kv)
    return SequenceState(model=state._model, ids=state._ids, mask=state._mask, logprobs=state._logprobs,
                         weights=state._weights, kv=kv, batch=state.batch, samples=state.samples, last=state._last)
