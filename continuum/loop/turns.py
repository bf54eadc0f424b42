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
from concurrent.futures import ThreadPoolExecutor
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


def needs_turns(state: SequenceState, sampler: Sampler, options: dict) -> bool:
    """Whether the call must run in turns: more rows than the backend decodes at once, and rows that can be split
    (several prompts, or a prompt's independent samples; no beams, not a stream: a stream's chunks come from one
    loop)."""
    limit = state._model.max_call_rows
    if limit is None or sampler.is_beam_search or options.get("track_text"):
        return False
    per = _per_prompt(state, sampler, options)
    return state.batch * per > limit and (state.batch > 1 or (per > limit and _splits_samples(state, sampler, options)))


def in_turns(decode: Callable[..., Generator[Any, None, Any]], state: SequenceState, sampler: Sampler,
             options: dict) -> SequenceState:
    """Run ``decode`` on parts of ``state``'s rows, at most ``max_call_rows`` each, concurrently; put them back."""
    limit, per = state._model.max_call_rows, _per_prompt(state, sampler, options)
    token = cancel.current()  # (each part's loop checks the caller's Ctrl-C and progress, as its own would)

    def run(job: tuple[Any, Sampler, dict]) -> Any:
        part, smp, opts = job
        saved = cancel.current()
        cancel._local.token = token
        try:
            steps = decode(part, smp, **opts)
            while True:
                next(steps)  # (not a stream: nothing is yielded, the first next ends it)
        except StopIteration as done:
            return done.value
        finally:
            cancel._local.token = saved

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
        with ThreadPoolExecutor(len(jobs), thread_name_prefix="continuum-turns") as pool:
            done = list(pool.map(run, jobs))
        prompts = [concat_samples(done[b * groups:(b + 1) * groups]) for b in range(state.batch)]
        return SequenceState.stack(prompts)
    k = max(1, limit // per)
    jobs = [(state[i:i + k, :], sampler, options) for i in range(0, state.batch, k)]  # (list calls: prompts in parts)
    with ThreadPoolExecutor(len(jobs), thread_name_prefix="continuum-turns") as pool:
        return SequenceState.stack(list(pool.map(run, jobs)))


def _with_samples(sampler: Sampler, samples: int) -> MultinomialSampler:
    assert isinstance(sampler, MultinomialSampler)
    return MultinomialSampler(samples, top_k=sampler.top_k, top_p=sampler.top_p, temperature=sampler.temperature)
