"""The decoding loop: one loop for every generator, from any ``SequenceState``.

::

    state ──▶ prefill the uncached suffix (ONE forward) ──▶ logits
                 ▲                                            │ log-softmax, guide mask
                 │                                            ▼
           forward the new column ◀── append, advance guides ◀── sampler: ids, ancestors, scores
                                      check EOS / stop strings     reorder ALL per-row state (Rows.reorder)

The loop (:func:`_decode`: its setup in :mod:`continuum.loop.setup`, its steps in :mod:`continuum.loop.steps`, its
result in :mod:`continuum.loop.finish`) is a Python generator run by
the model's engine (:mod:`continuum.loop.engine`): it yields a :class:`~continuum.models.request.Request` wherever
it needs the model (the engine resumes it with the result, merged with every running call's), a :class:`Step`
after each step when it is streamed, and returns the final ``SequenceState``. When the guide forces the tokens
after a sampled one, the whole run is appended and computed in the same next forward pass
(:mod:`continuum.loop.fastforward`).
"""

from __future__ import annotations

import logging
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
from ..speculate import Speculator
from ..state import SequenceState
from .arrivals import GATE
from .cfg import Guidance
from .checks import check_continuable, check_max_tokens, check_rng
from .finish import finish
from .rows import Rows
from .setup import prefill, recompute_stale, setup
from .steps import CallLoop
from .turns import apart, in_turns, longest, needs_turns

logger = logging.getLogger(__name__)

__all__ = ["decode", "prefill", "recompute_stale", "Step", "check_max_tokens", "check_rng", "check_continuable",
           "positions"]


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
        need = rows * kv_bytes(model, longest(state, options))
        if model.kv_budget is not None and need > model.kv_budget:  # (it could never run within the budget)
            engine.arrivals.arrived()
            loop.close()
            what = ("the beams (a prompt's beams advance together: they cannot run in parts)" if sampler.is_beam_search
                    else "the rows")
            raise KVCacheFullError(f"this call's {rows} rows may reach {need} bytes of KV cache (input plus max_tokens), "
                                   f"more than the model's kv_budget of {model.kv_budget} bytes: lower max_tokens or "
                                   f"{what}, or raise kv_budget")
        new = options.get("max_tokens")
        spec = options.get("speculate")  # (a step's drafts take cells too, until the rejected ones are cut)
        grow = rows * (new + (spec.max_draft if spec is not None else 0)) if new is not None else None
        call = engine.submit(loop, first, rows, stream=stream, kv_bytes=need, grow=grow)
        try:
            if call.queue is not None:
                return (yield from engine.stream(call))
            try:
                return engine.wait(call)
            except KVCacheFullError:  # alone, and still no room: its rows may fit apart (issue 56)
                if not apart(state, sampler, options):
                    raise
        finally:
            engine.close(call)  # (a no-op once the call is done)
        logger.info("a call of %d rows without max_tokens outgrew the KV pool together: its rows run again as parts, "
                    "each parked while the others need the room (pass max_tokens to split it up front)", rows)
        return in_turns(decode, state, sampler, options, limit=1)
    finally:
        if getattr(model, "prefix_cache", None) is not None:
            model.prefix_cache.settle()  # prefixes registered as being computed and not inserted (an error)


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
    ready = setup(state, sampler, guide=guide, max_tokens=max_tokens, stop_at=stop_at, rng=rng, track_text=track_text,
                  guidance=guidance, token_healing=token_healing, speculate=speculate)
    state, rows, steps, exhausted = ready.state, ready.rows, ready.steps, ready.exhausted
    model, tok = state._model, state._model.tokenizer
    group, n = state.samples, sampler.samples
    C = kvcache.length(rows.kv)
    if steps == 0:
        if n != group:  # fork: the samples share the prefilled cache
            fork = torch.arange(state.rows).repeat_interleave(n)
            rows.reorder(fork)
            rows.scores = rows.scores.index_select(0, fork.to(rows.scores.device))
        return finish(state, rows, C, n, guide, kind, parse, max_tokens, sampler, exhausted)
    eos, pad = tok.eos_token_ids | frozenset(extra_eos), tok.pad_token_id
    loop = CallLoop(rows, sampler, guide=guide, rng=rng, steps=steps, group=group, exhausted=exhausted, eos=eos,
                    pad=pad, fast_forward=fast_forward, track_text=track_text, step=_step, speculate=speculate)
    owner = threading.get_ident()  # the caller's thread: prefixes it registered as being computed (in-batch sharing)
    fed, group = yield from loop.run(model, C, owner)
    if rows.branch is not None:
        rows.kv = rows.branch.release(rows.kv)
    return finish(state, rows, fed, group, guide, kind, parse, max_tokens, sampler, exhausted,
                   loop.stats if loop.spec is not None else None)
