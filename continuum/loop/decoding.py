"""The decoding loop: one loop for every generator, from any ``SequenceState``.

::

    state ──▶ prefill the uncached suffix (ONE forward) ──▶ logits
                 ▲                                            │ log-softmax, guide mask
                 │                                            ▼
           forward the new column ◀── append, advance guides ◀── sampler: ids, ancestors, scores
                                      check EOS / stop strings     reorder ALL per-row state (Rows.reorder)

The loop (:func:`_decode`: the setup here, the steps in :mod:`continuum.loop.steps`) is a Python generator run by
the model's engine (:mod:`continuum.loop.engine`): it yields a :class:`~continuum.models.request.Request` wherever
it needs the model (the engine resumes it with the result, merged with every running call's), a :class:`Step`
after each step when it is streamed, and returns the final ``SequenceState``. When the guide forces the tokens
after a sampled one, the whole run is appended and computed in the same next forward pass
(:mod:`continuum.loop.fastforward`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from ..errors import KVCacheFullError
from ..guides import Guide
from ..models import kv as kvcache
from ..models.kv import positions  # (re-exported: it lives with the cache's column layout)
from ..models.memory import kv_bytes
from ..samplers import Sampler
from ..speculate import Speculator, check_speculator
from ..state import LastStep, SequenceState
from ..state.combine import lead_space
from .arrivals import GATE
from .cfg import Guidance, UnconditionalBranch
from .checks import check_continuable, check_max_tokens, check_rng, stop_list
from .fastforward import step_marks
from .healing import heal
from .parallel import check_seeded
from .rows import Rows
from .steps import CallLoop
from .turns import in_turns, needs_turns

__all__ = ["decode", "prefill", "Step", "check_max_tokens", "check_rng", "check_continuable", "positions"]


@dataclass
class Step:
    """What one decoding step did: the generated text of every row so far (when tracked), and with a reasoning
    guide each row's phase after it (``ReasoningGuide.phases``)."""

    texts: list[str] | None
    reordered: bool
    phases: list[str | None] | None = None


def _step(rows: Rows, reordered: bool) -> Step:
    """A stream's chunk. The phases are read here, in the loop's own thread: a stream's consumer runs behind the
    loop (the engine's thread decodes on while it reads), so a guide it read later would be steps ahead of the text."""
    phases = getattr(rows.guide, "phases", None)
    return Step(rows.step_texts(), reordered, phases() if phases is not None else None)


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
    stale = set(find(state._kv)) if find is not None and state._kv is not None else set()
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


def decode(state: SequenceState, sampler: Sampler, **options) -> Generator[Step, None, SequenceState]:
    """Continue ``state`` with ``sampler``: the decoding loop (:func:`_decode`, same options), run by the
    model's engine with every other running call (:mod:`continuum.loop.engine`).

    The checks, the prefix cache and the rows are set up here, in the caller's thread (a bad input
    raises here); the loop then joins the engine's next step. Without ``track_text`` (a plain call)
    this yields nothing: the caller waits once for the final state. With it (a stream) the steps
    come through a queue; closing this generator takes the loop out at the engine's next step.
    """
    if needs_turns(state, sampler, options):  # more rows than the backend decodes at once: prompts in turns
        return in_turns(decode, state, sampler, options)
    model = state._model
    engine = model.engine
    loop = _decode(state, sampler, **options)
    try:
        stream = bool(options.get("track_text"))
        engine.arrivals.arrive()  # (the next step waits a little for this setup: calls started together prefill together)
        try:
            with GATE.held():  # (few setups at once: the engine's steps are not starved of the GIL)
                first = next(loop)  # the setup, up to the loop's first forward request
        except StopIteration as done:  # nothing left to compute (max_tokens=0)
            engine.arrivals.arrived()
            return done.value
        except BaseException:
            engine.arrivals.arrived()
            raise
        rows = state.rows * max(1, sampler.samples // max(state.samples, 1)) * (2 if options.get("guidance") else 1)
        need = rows * kv_bytes(model, _longest(state, options))
        if model.kv_budget is not None and need > model.kv_budget:  # (it could never run within the budget)
            engine.arrivals.arrived()
            loop.close()
            raise KVCacheFullError(f"this call's {rows} rows may reach {need} bytes of KV cache (input plus max_tokens), "
                                   f"more than the model's kv_budget of {model.kv_budget} bytes: lower max_tokens or "
                                   "the rows, or raise kv_budget")
        new = options.get("max_tokens")
        spec = options.get("speculate")  # (a step's drafts take cells too, until the rejected ones are cut)
        grow = rows * (new + (spec.max_draft if spec is not None else 0)) if new is not None else None
        call = engine.submit(loop, first, rows, stream=stream, kv_bytes=need, grow=grow)
        try:
            if call.queue is None:
                return engine.wait(call)
            return (yield from engine.stream(call))
        finally:
            engine.close(call)  # (a no-op once the call is done)
    finally:
        if getattr(model, "prefix_cache", None) is not None:
            model.prefix_cache.settle()  # prefixes registered as being computed and not inserted (an error)


def _longest(state: SequenceState, options: dict) -> int:
    """The most columns a call on ``state`` may reach: its input plus ``max_tokens``, within the context."""
    ctx, new = state._model.context_length, options.get("max_tokens")
    longest = state._ids.shape[1] + (new if new is not None else (ctx or 0))
    return min(longest, ctx) if ctx else longest


def _decode(
    state: SequenceState,
    sampler: Sampler,
    *,
    guide: Guide | None = None,
    max_tokens: int | None = None,
    stop_at=None,
    rng: torch.Generator | None = None,
    kind: str = "text",
    parse: Callable[[str], object] | None = None,
    track_text: bool = False,
    guidance: Guidance | None = None,
    fast_forward: bool = True,
    token_healing: bool = False,
    extra_eos: frozenset = frozenset(),
    speculate: Speculator | None = None,
) -> Generator[Step, None, SequenceState]:
    """Continue ``state`` with ``sampler`` (and ``guide``, and classifier-free guidance ``guidance``); yields a
    :class:`Step` per forward pass, returns the new state.

    ``fast_forward``: append the tokens the guide forces after a sampled token and compute them in
    the same next forward pass (:mod:`continuum.loop.fastforward`); ``max_tokens`` counts them.
    ``token_healing``: back up each row's last token and constrain the first generated token to
    re-cover its text (:mod:`continuum.loop.healing`); the output still starts after the input's text.
    ``extra_eos``: token ids that end a row like the tokenizer's EOS ids (a chat's end-of-turn token).
    ``speculate``: a speculator (:mod:`continuum.speculate`): drafted tokens verified in each step's forward.
    With guidance the unconditional branch runs one column per step, so forced runs are not fast-forwarded.
    """
    check_max_tokens(max_tokens)
    check_speculator(speculate, sampler, state._model)
    stops = stop_list(stop_at)
    check_rng(rng)
    steps = check_continuable(state, sampler, max_tokens)
    check_seeded(state._model, sampler, rng)  # under torchrun: every rank must draw the same tokens
    exhausted = "length" if max_tokens is not None and steps == max_tokens else "context"  # why the last step ends
    model, tok = state._model, state._model.tokenizer
    group, n = state.samples, sampler.samples

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
    C = kvcache.length(rows.kv)
    eos, pad = tok.eos_token_ids | frozenset(extra_eos), tok.pad_token_id
    if steps == 0:
        if n != group:  # fork: the samples share the prefilled cache
            fork = torch.arange(state.rows).repeat_interleave(n)
            rows.reorder(fork)
            rows.scores = rows.scores.index_select(0, fork.to(rows.scores.device))
        return _finish(state, rows, C, n, guide, kind, parse, max_tokens, sampler, exhausted)
    loop = CallLoop(rows, sampler, guide=guide, rng=rng, steps=steps, group=group, exhausted=exhausted, eos=eos,
                    pad=pad, fast_forward=fast_forward, track_text=track_text, step=_step, speculate=speculate)
    owner = threading.get_ident()  # the caller's thread: prefixes it registered as being computed (in-batch sharing)
    fed, group = yield from loop.run(model, C, owner)
    if rows.branch is not None:
        rows.kv = rows.branch.release(rows.kv)
    return _finish(state, rows, fed, group, guide, kind, parse, max_tokens, sampler, exhausted,
                   loop.stats if loop.spec is not None else None)


def _finish(state: SequenceState, rows: Rows, fed: int, samples: int, guide, kind, parse, max_tokens, sampler,
            exhausted: str, speculation: dict | None = None) -> SequenceState:
    """Assemble the result state: normalise the layout, order beams, apply stop strings, record the step."""
    rows.flush()
    R, tok = rows.ids.shape[0], state._model.tokenizer
    for r in range(R):  # rows still running when the steps ran out
        if rows.reason[r] is None:
            rows.end(r, exhausted)
    kv = kvcache.finish(rows.kv, fed)  # (a view of merged storage gets its own copy: a small part must not pin it)
    raw = SequenceState(model=state._model, ids=rows.ids[:, :rows.width], mask=rows.mask[:, :rows.width],
                        logprobs=rows.lp[:, :rows.width], weights=rows.weights, kv=kv,
                        batch=state.batch, samples=samples)
    real, cached = raw._real_rows(), raw._cached_real()
    tails = [(ids[c:], lps[c:]) for (ids, lps), c in zip(real, cached)]
    out = raw._rebuild(cached, tails, rows.weights, None)
    order = list(range(R))
    if sampler.is_beam_search:  # best first, by the score the search ranked with
        scores = rows.scores.tolist()
        order = [b * samples + i for b in range(state.batch)
                 for i in sorted(range(samples), key=lambda i: -scores[b * samples + i])]
        if order != list(range(R)):
            out = out._select(order, state.batch, samples)
    texts = out.texts
    starts = [rows.start_chars[r] for r in order]  # where each row's detokenized text begins
    cuts = [rows.stop_cut[r] for r in order]
    ends = [s + c if c is not None else len(t) for s, c, t in zip(starts, cuts, texts)]
    starts = [s + rows.heal_chars[r] for s, r in zip(starts, order)]  # a healed token's removed text is input
    complete = tuple(rows.complete[r] or (guide is not None and guide.is_final(rows.guide_states[r]))
                     if rows.guide_states is not None else True for r in order)
    resumable = None
    if guide is not None and rows.guide_states is not None and not any(c is not None for c in cuts):
        resumable = tuple(rows.guide_states[r] for r in order)
    real = out._real_rows()  # forced and healed tokens, for the display (LastStep.marks)
    marks = tuple(step_marks(tok, real[i][0], texts[i], rows.generated[r],
                             {**{o: "forced" for o in rows.forced[r]}, **({0: "healed"} if rows.heal_chars[r] else {})},
                             starts[i]) for i, r in enumerate(order))
    last = LastStep(kind=kind, starts=tuple(starts), ends=tuple(ends), complete=complete, parse=parse,
                    max_tokens=max_tokens, guide_key=guide.key if guide is not None else None, guide_states=resumable,
                    finish=tuple(rows.reason[r] or exhausted for r in order), marks=marks,  # (every row ended above)
                    speculation=dict(speculation) if speculation is not None else None)
    if any(c is not None for c in cuts):
        out = out._truncate(ends)
    return SequenceState(model=out._model, ids=out._ids, mask=out._mask, logprobs=out._logprobs, weights=out._weights,
                         kv=out._kv, batch=out.batch, samples=out.samples, last=last)
