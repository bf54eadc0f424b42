"""Rows in turns: a list call with more rows than the backend can decode at once.

A llama.cpp model decodes at most its sequence ids' worth of rows at once (256, ``Backend.max_call_rows``), and no
call's rows may exceed the engine's ``max_rows`` (such a call would only run alone). Rows
that need not advance together are split: the prompts of a list call, and the independent samples of a fresh
``multinomial(n)`` draw (in groups, each with a generator seeded from the caller's ``rng``, so a seeded call is
reproducible; it is not the draw one call of n rows would make). Each part is a call of its own, submitted at once
from worker threads: the engine merges their steps and parks what does not fit (``room.py``); their states are put
back in order. Rows that must advance together (one prompt's beams) are not split: a beam call's prompts run in
parts, each with all its beams, and one prompt's beams that outnumber the bound are refused by the backend
(``SequencesExhaustedError``).

Example:
    >>> generate.text(gguf_model)([f"Story {i}:" for i in range(300)], max_tokens=8)   # doctest: +SKIP
    >>> generate.text(gguf_model, samplers.multinomial(300))("Once", max_tokens=8)    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import torch

from ..models.memory import kv_bytes
from ..samplers import MultinomialSampler, Sampler
from ..state import SequenceState
from ..state.combine import concat_samples
from . import cancel
from .arrivals import GATE
from .checks import check_continuable, check_lengths, check_max_tokens, check_rng
from .driving import never_drive

__all__ = ["needs_turns", "in_turns", "apart", "choice_prompts", "in_parts"]


def _per_prompt(state: SequenceState, sampler: Sampler, options: dict) -> int:
    """Rows each prompt of ``state`` decodes (its samples, twice with classifier-free guidance's branch)."""
    return max(state.samples, sampler.samples) * (2 if options.get("guidance") else 1)


def _splits_samples(state: SequenceState, sampler: Sampler, options: dict) -> bool:
    """Independent samples (``multinomial(n)`` on one-sample rows, a fresh draw; or one draw each on a state's own
    samples, no guidance) can be drawn in groups: each group its own call, with its own generator seeded from the
    caller's. (Only where the prompt and its samples cannot fit together: :func:`row_limit`.)"""
    return isinstance(sampler, MultinomialSampler) and not options.get("guidance") and (
        state.samples == 1 or sampler.samples in (1, state.samples))


def _step_rows(model) -> int | None:
    """The most rows one call may decode at once: the backend's sequence ids (``max_call_rows``) and the engine's
    ``max_rows`` (a wider call would only ever run alone, holding every later call behind it: issue 56)."""
    bounds = [b for b in (model.max_call_rows, getattr(getattr(model, "engine", None), "max_rows", None)) if b is not None]
    return min(bounds) if bounds else None


def row_limit(state: SequenceState, sampler: Sampler, options: dict) -> int | None:
    """The most rows of this call that can decode at once (None: unbounded): :func:`_step_rows` and, on a fixed pool
    with ``max_tokens`` given, its cells. A prompt's samples share its cells: a prompt and its ``n`` samples take
    ``input + n x max_tokens`` cells; independent samples of a fresh draw that do not fit with their prompt are split
    into groups that do (each group its own prompt copy)."""
    model = state._model
    limit = _step_rows(model)
    measure = getattr(model, "capacity", None)
    cap = measure([]) if measure is not None else None
    new = options.get("max_tokens")
    budget = getattr(model, "kv_budget", None)
    if cap is None and budget is not None and new:  # transformers under a kv_budget (bytes)
        fit = _budget_rows(state, budget, options)
        return fit if limit is None else limit if fit is None else min(limit, fit)
    if limit is None or cap is None or not new:
        return limit
    width, per = _prompt_cells(state), _per_prompt(state, sampler, options)
    prompts = cap.total // (width + per * new)  # whole prompts, each with all its samples
    if prompts == 0 and _splits_samples(state, sampler, options):  # one prompt's samples in groups
        # (a fresh draw's groups each copy the prompt; a state's own samples take their share of its cells each)
        by_cells = (cap.total - width) // new if state.samples == 1 else cap.total * per // (width + per * new)
    else:
        by_cells = max(1, prompts) * per  # (a prompt that cannot fit alone is the backend's clear error)
    return max(1, min(limit, by_cells))


def longest(state: SequenceState, options: dict) -> int:
    """The most columns a call on ``state`` may reach: its input plus ``max_tokens``, within the context."""
    ctx, new = state._model.context_length, options.get("max_tokens")
    most = state._ids.shape[1] + (new if new is not None else (ctx or 0))
    return min(most, ctx) if ctx else most


def _budget_rows(state: SequenceState, budget: int, options: dict) -> int | None:
    """The rows of a call that fit a transformers model's ``kv_budget`` together, each priced as the engine prices a
    call's rows up front (``decoding.decode``: :func:`longest` columns each); None when none of them has KV bytes.
    Without it a list call whose prompts each fit was refused (``KVCacheFullError``) where ``run_batch`` of the same
    programs ran."""
    each = kv_bytes(state._model, longest(state, options))
    return max(1, budget // each) if each > 0 else None


def _prompt_cells(state: SequenceState) -> int:
    """The most cells one prompt's input rows may hold: a one-sample state's width; a prompt's samples, the cells
    their KV holds together (``model.rows_cells``: a fork's shared prefix once) and every row's uncached tokens (not
    shared, even where the tokens are the same: ``state + state``, ``state + text``); without a pool model every
    row's tokens. Pricing samples as one prompt, the long oracle's 2 prompts x 3
    samples with ~45 tokens of their own after a shared 18 took 68 cells a prompt, ran as one call on a 256-cell pool
    and failed with ``KVCacheFullError``; priced by their tokens, the prompts run as two parts, which the engine
    admits as they fit. (An overestimate only splits prompts that could have shared a call; the parts still share
    steps.) At least what a row's sequence takes resident (``model.row_cells``): a hybrid's 65-token view of a
    spilled 146-token state restores all 146 (its bytes cannot be cut; the stress driver: a 2-row call refused on a
    256-cell pool, its rows priced at their 78-token width)."""
    together = getattr(state._model, "rows_cells", None)
    if state.samples > 1 and together is not None and state._kv is not None:  # (a fork's shared cells once)
        real, cached = state._mask.sum(1).tolist(), state._cached_real()
        S = state.samples
        return max(together(state._kv, list(range(b * S, b * S + S)))
                   + sum(int(real[r]) - cached[r] for r in range(b * S, b * S + S)) for b in range(state.batch))
    held = getattr(state._model, "row_cells", None)
    least = held(state._kv) if held is not None and state._kv is not None else 0
    if state.samples == 1:
        return max(least, int(state._ids.shape[1]))
    return max(least, int(state._mask.sum(1).view(state.batch, state.samples).sum(1).max()))


def needs_turns(state: SequenceState, sampler: Sampler, options: dict) -> bool:
    """Whether the call must run in turns: more rows than the backend decodes at once (:func:`row_limit`), and
    rows that can be split (several prompts, each with all its beams, or a prompt's independent samples; not a
    stream: a stream's chunks come from one loop). Before, a beam call was never split: 6 prompts x beam_search(4) on
    a 16-id pool were refused (``SequencesExhaustedError``) though 3 prompts' beams fit at a time."""
    if options.get("track_text"):
        return False
    per = _per_prompt(state, sampler, options)
    if state.batch * per == 1:  # (one row: every limit is at least one row; a lone call, its checks not walked)
        return False
    limit = row_limit(state, sampler, options)
    if limit is None:
        return False
    return state.batch * per > limit and (state.batch > 1 or (per > limit and _splits_samples(state, sampler, options)))


def apart(state: SequenceState, sampler: Sampler, options: dict) -> bool:
    """Whether a call that found no room in a fixed pool while running alone may still complete with its rows apart:
    rows that need not advance together (several prompts, or a prompt's independent samples; no beams, not a stream)
    and no ``max_tokens`` (a call with it is split by its cells up front: :func:`row_limit`). Rows that together
    outgrow the pool on their way to the context may each fit alone: as parts, the engine parks what does not fit."""
    if options.get("max_tokens") is not None or sampler.is_beam_search or options.get("track_text"):
        return False
    if getattr(state._model, "capacity", None) is None:  # (no fixed pool: nothing to make room in)
        return False
    per = _per_prompt(state, sampler, options)
    return state.batch > 1 or (per > 1 and _splits_samples(state, sampler, options))


def in_turns(decode: Callable[..., Generator[Any, None, Any]], state: SequenceState, sampler: Sampler,
             options: dict, limit: int | None = None) -> SequenceState:
    """Run ``decode`` on parts of ``state``'s rows, at most ``limit`` (default :func:`row_limit`) each, concurrently;
    put them back."""
    limit, per = limit or row_limit(state, sampler, options) or 1, _per_prompt(state, sampler, options)
    _check_up_front(state, options, sampler)
    token = cancel.CancelToken(cancel.current())
    run = _runner(token, lambda part, smp, opts: decode(part, smp, **opts))

    if per > limit and _splits_samples(state, sampler, options):  # each prompt's samples in groups
        groups = -(-per // limit)
        sizes = [per // groups + (g < per % groups) for g in range(groups)]
        jobs: list[tuple[Any, Sampler, dict]] = []
        for b in range(state.batch):
            start = 0
            for size in sizes:  # (a state's own samples: each group its share, one draw each)
                if state.samples > 1:
                    part = state[b:b + 1, start:start + size, :]
                else:
                    part = state if state.batch == 1 else state[b:b + 1, :]
                jobs.append((part, _with_samples(sampler, size), seeded(options)))
                start += size
        done = _run_all(run, jobs, token, _at_once(state, max(sizes)))
        prompts = [concat_samples(done[b * groups:(b + 1) * groups]) for b in range(state.batch)]
        return SequenceState.stack(prompts)
    k = max(1, limit // per)
    jobs = [(state[i:i + k, :, :], sampler, seeded(options)) for i in range(0, state.batch, k)]  # (prompts in parts)
    return SequenceState.stack(_run_all(run, jobs, token, _at_once(state, k * per)))


def seeded(options: dict) -> dict:
    """``options`` with a generator of its own seeded from the caller's ``rng`` (drawn here, in order): parts run
    concurrently, and one shared generator would be drawn in whatever order their threads reach it, so a seeded
    call would not be reproducible."""
    rng = options.get("rng")
    if rng is None:
        return options
    return {**options, "rng": torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=rng)))}


def choice_prompts(state: SequenceState, option_lengths: list[int]) -> int | None:
    """Prompts (batch items, with their samples) one choice call may score at once, or None when all fit. Each row
    takes a sequence id of its own plus one per option (its tree's leaves, llama.cpp), and cells for its input and
    its tree's nodes (at most every option's tokens and the root)."""
    model = state._model
    rows = _step_rows(model)
    if rows is None:
        return None
    K, per = len(option_lengths), state.samples
    by_ids = model.max_call_rows // (per * (1 + K)) if model.max_call_rows else state.batch
    by_rows = rows // per
    measure = getattr(model, "capacity", None)
    cap = measure([]) if measure is not None else None
    width = max(int(state._ids.shape[1]), _prompt_cells(state) if per == 1 else 0)
    by_cells = state.batch if cap is None else cap.total // (per * (width + 1 + sum(option_lengths)))
    k = max(1, min(by_ids, by_rows, by_cells))
    return k if k < state.batch else None


def in_parts(run_part: Callable[[SequenceState, dict], Generator[Any, None, Any]], state: SequenceState, k: int,
             options: dict) -> SequenceState:
    """``run_part(part, options)`` on every ``k`` prompts of ``state`` at once (each part's ``rng`` seeded from the
    caller's); their states stacked in order."""
    _check_up_front(state, options)
    token = cancel.CancelToken(cancel.current())
    run = _runner(token, run_part)
    jobs = [(state[i:i + k, :, :], seeded(options)) for i in range(0, state.batch, k)]
    return SequenceState.stack(_run_all(run, jobs, token, _at_once(state, k * state.samples)))


def _check_up_front(state: SequenceState, options: dict, sampler: Sampler | None = None) -> None:
    """What every part checks in its own setup, on all rows before any part starts: parts start as earlier ones end
    (:func:`_at_once`), and a bad last row must fail the call at once, not after the parts before it have run. With
    the call's sampler: its rows must fit in memory all together too (they are stacked into one result)."""
    check_max_tokens(options.get("max_tokens"))
    check_rng(options.get("rng"))
    if sampler is None:
        check_lengths(state)
    else:
        check_continuable(state, sampler, options.get("max_tokens"))


def _runner(token: cancel.CancelToken, loop: Callable[..., Generator[Any, None, Any]]) -> Callable[[tuple], Any]:
    """A part's job: ``loop(*job)`` run to its end, under ``token``: the caller's (its Ctrl-C, a run_batch's cancel)
    or, set here, the call's own, cancelled when the caller is interrupted or a part fails (the others stop at their
    next step)."""
    def run(job: tuple) -> Any:
        never_drive()  # (a short-lived thread: the engine's own thread, or run_batch's host, computes)
        try:
            with cancel.bound(token):
                steps = loop(*job)
                while True:
                    next(steps)  # (not a stream: nothing is yielded, the first next ends it)
        except StopIteration as done:
            return done.value
        except BaseException:
            token.cancel()
            raise

    return run


def _at_once(state: SequenceState, part_rows: int) -> int:
    """Parts of one call in flight at once: as many as the engine's ``max_rows`` holds. The next part is submitted
    when one ends, so calls that arrive meanwhile are admitted before it (arrival order), instead of waiting behind
    every part of a wide call."""
    rows = _step_rows(state._model)
    return max(1, (rows or part_rows) // max(1, part_rows))


def _run_all(run: Callable[[Any], Any], jobs: list, token: cancel.CancelToken, at_once: int) -> list:
    """The parts on ``at_once`` worker threads, results in order. The first failure (or the caller's Ctrl-C while it
    waits) cancels the others, which leave at their next step (those not started never start); the caller gets that
    first error, the cancelled parts' own errors dropped. The caller waits off the gate: the parts need it."""
    with GATE.waiting():
        return _run_parts(run, jobs, token, at_once)


def _run_parts(run: Callable[[Any], Any], jobs: list, token: cancel.CancelToken, at_once: int) -> list:
    pool = ThreadPoolExecutor(min(len(jobs), at_once), thread_name_prefix="continuum-turns")
    futures = [pool.submit(run, job) for job in jobs]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        first = next((f.exception() for f in futures if f.done() and f.exception() is not None
                      and not isinstance(f.exception(), cancel.Cancelled)), None)
        if first is not None:
            raise first
        return [f.result() for f in futures]
    except BaseException:
        token.cancel()
        pool.shutdown(wait=True, cancel_futures=True)  # (parts not started yet never start)
        raise
    finally:
        pool.shutdown(wait=True)  # (cancelled parts leave within a step: nothing runs on after the call returns)


def _with_samples(sampler: Sampler, samples: int) -> MultinomialSampler:
    assert isinstance(sampler, MultinomialSampler)
    return MultinomialSampler(samples, top_k=sampler.top_k, top_p=sampler.top_p, temperature=sampler.temperature)
