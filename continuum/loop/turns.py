"""Rows in turns: a list call with more rows than the backend can decode at once.

A llama.cpp model decodes at most its sequence ids' worth of rows at once (256, ``Backend.max_call_rows``). The
prompts of a list call need not advance together, so such a call runs as several calls of at most that many
rows, submitted at once from worker threads: the engine merges their steps and parks what does not fit
(``room.py``); their states are stacked back in the prompts' order. Rows that must advance together (one prompt's
beams, or its samples) are not split: a prompt whose own rows exceed the bound is refused by the backend
(``SequencesExhaustedError``).

Example:
    >>> generate.text(gguf_model)([f"Story {i}:" for i in range(300)], max_tokens=8)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..samplers import Sampler
from ..state import SequenceState
from . import cancel

__all__ = ["needs_turns", "in_turns"]


def _per_prompt(state: SequenceState, sampler: Sampler, options: dict) -> int:
    """Rows each prompt of ``state`` decodes (its samples, twice with classifier-free guidance's branch)."""
    return max(state.samples, sampler.samples) * (2 if options.get("guidance") else 1)


def needs_turns(state: SequenceState, sampler: Sampler, options: dict) -> bool:
    """Whether the call must run in turns: more rows than the backend decodes at once, prompts that can be split
    (more than one, no beams, not a stream: a stream's chunks come from one loop)."""
    limit = state._model.max_call_rows
    return (limit is not None and state.batch > 1 and not sampler.is_beam_search and not options.get("track_text")
            and state.batch * _per_prompt(state, sampler, options) > limit)


def in_turns(decode: Callable[..., Generator[Any, None, Any]], state: SequenceState, sampler: Sampler,
             options: dict) -> SequenceState:
    """Run ``decode`` on parts of ``state``'s prompts, at most ``max_call_rows`` rows each, concurrently; stack."""
    k = max(1, state._model.max_call_rows // _per_prompt(state, sampler, options))
    parts = [state[i:i + k, :] for i in range(0, state.batch, k)]
    token = cancel.current()  # (each part's loop checks the caller's Ctrl-C and progress, as its own would)

    def run(part: SequenceState) -> Any:
        saved = cancel.current()
        cancel._local.token = token
        try:
            steps = decode(part, sampler, **options)
            while True:
                next(steps)  # (not a stream: nothing is yielded, the first next ends it)
        except StopIteration as done:
            return done.value
        finally:
            cancel._local.token = saved

    with ThreadPoolExecutor(len(parts), thread_name_prefix="continuum-turns") as pool:
        return SequenceState.stack(list(pool.map(run, parts)))
