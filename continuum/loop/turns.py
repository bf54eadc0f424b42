"""Rows in turns: a list call with more rows than the backend can decode at once.

A llama.cpp model decodes at most its sequence ids' worth of rows at once (256, ``Backend.max_call_rows``). Rows
that need not advance together are split: the prompts of a list call, and the independent samples of a fresh
``multinomial(n)`` draw (in groups, each with a generator seeded from the caller's ``rng``, so a seeded call is
reproducible; it is not the draw one call of n rows would make). Each part is a call of its own, submitted at once
from worker threads: the engine merges their steps and parks what does not fit (``room.py``); their states are put
back in order. Rows that must advance together (one prompt's beams) are not split: a group larger than the bound
is refused by the backend (``SequencesExhaustedError``).

Example:
    >>> generate.text(gguf_model)([f"Story {i}:" for i in range(300)], max_tokens=8)   # doctest: +SKIP
    >>> generate.text(gguf_model, samplers.multinomial(300))("Once", max_tokens=8)    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import torch

from ..samplers import MultinomialSampler, Sampler
from ..state import SequenceState
from ..state.combine import concat_samples
from . import cancel

__all__ = ["needs_turns", "in_turns"]


def _per_prompt(state: SequenceState, sampler: Sampler, options: dict) -> int:
    """Rows each prompt of ``state`` decodes (its samples, twice with classifier-free guidance's branch)."""
    return max(state.samples, sampler.samples) * (2 if options.get("guidance") else 1)


def _splits_samples(state: SequenceState, sampler: Sampler, options: dict) -> bool:
    """Independent samples of a fresh draw (``multinomial(n)`` on one-sample rows, no guidance) can be drawn in
    groups: each group its own call, with its own generator seeded from the caller's."""
    return isinstance(sampler, MultinomialSampler) and state.samples == 1 and not options.get("guidance")


def row_limit(state: SequenceState, sampler: Sampler, options: dict) -> int | None:
    """The most rows of this call that can decode at once: the backend's sequence ids (``max_call_rows``) and, on a
    fixed pool with ``max_tokens`` given, its cells: rows of separate prompts each need their input plus
    ``max_tokens`` cells; samples of one prompt share its cells and need ``max_tokens`` each (None: unbounded)."""
    model = state._model
    limit = model.max_call_rows
    measure = getattr(model, "capacity", None)
    cap = measure([]) if measure is not None else None
    new = options.get("max_tokens")
    if limit is None or cap is None or not new:
        return limit
    width = int(state._ids.shape[1])
    if state.batch == 1 and _splits_samples(state, sampler, options):
        by_cells = (cap.total - width) // new
    else:
        by_cells = cap.total // (width + new) * _per_prompt(state, sampler, options)
    return max(1, min(limit, by_cells))


def needs_turns(state: SequenceState, sampler: Sampler, options: dict) -> bool:
    """Whether the call must run in turns: more rows than the backend decodes at once (:func:`row_limit`), and
    rows that can be split (several prompts, or a prompt's independent samples; no beams, not a stream: a stream's
    chunks come from one loop)."""
    if sampler.is_beam_search or options.get("track_text"):
        return False
    limit = row_limit(state, sampler, options)
    if limit is None:
        return False
    per = _per_prompt(state, sampler, options)
    return state.batch * per > limit and (state.batch > 1 or (per > limit and _splits_samples(state, sampler, options)))


def in_turns(decode: Callable[..., Generator[Any, None, Any]], state: SequenceState, sampler: Sampler,
             options: dict) -> SequenceState:
    """Run ``decode`` on parts of ``state``'s rows, at most :func:`row_limit` each, concurrently; put them back."""
    limit, per = row_limit(state, sampler, options) or 1, _per_prompt(state, sampler, options)
    # each part's loop checks this token: the caller's (its Ctrl-C, a run_batch's cancel) or, set here, the call's
    # own, cancelled when the caller is interrupted or a part fails (the others stop at their next step)
    token = cancel.CancelToken(cancel.current())

    def run(job: tuple[Any, Sampler, dict]) -> Any:
        part, smp, opts = job
        try:
            with cancel.bound(token):
                steps = decode(part, smp, **opts)
                while True:
                    next(steps)  # (not a stream: nothing is yielded, the first next ends it)
        except StopIteration as done:
            return done.value
        except BaseException:
            token.cancel()
            raise

    if per > limit and _splits_samples(state, sampler, options):  # each prompt's samples in groups
        groups = -(-per // limit)
        sizes = [per // groups + (g < per % groups) for g in range(groups)]
        rng = options.get("rng")
        jobs: list[tuple[Any, Sampler, dict]] = []
        for b in range(state.batch):
            for size in sizes:
                seed = int(torch.randint(0, 2**62, (1,), generator=rng)) if rng is not None else None
                g_opts = {**options, "rng": torch.Generator().manual_seed(seed) if seed is not None else None}
                jobs.append((state if state.batch == 1 else state[b:b + 1, :], _with_samples(sampler, size), g_opts))
        done = _run_all(run, jobs, token)
        prompts = [concat_samples(done[b * groups:(b + 1) * groups]) for b in range(state.batch)]
        return SequenceState.stack(prompts)
    k = max(1, limit // per)
    jobs = [(state[i:i + k, :], sampler, options) for i in range(0, state.batch, k)]  # (list calls: prompts in parts)
    return SequenceState.stack(_run_all(run, jobs, token))


def _run_all(run: Callable[[Any], Any], jobs: list, token: cancel.CancelToken) -> list:
    """Every part at once on worker threads, results in order. The first failure (or the caller's Ctrl-C while it
    waits) cancels the others, which leave at their next step; the caller gets that first error, the cancelled
    parts' own errors dropped."""
    pool = ThreadPoolExecutor(len(jobs), thread_name_prefix="continuum-turns")
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
        raise
    finally:
        pool.shutdown(wait=True)  # (cancelled parts leave within a step: nothing runs on after the call returns)


def _with_samples(sampler: Sampler, samples: int) -> MultinomialSampler:
    assert isinstance(sampler, MultinomialSampler)
    return MultinomialSampler(samples, top_k=sampler.top_k, top_p=sampler.top_p, temperature=sampler.temperature)
