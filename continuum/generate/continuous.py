"""``continuous(generator)``: the same generator, from and to ``SequenceState``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from ..errors import ContinuumTypeError
from ..loop.arrivals import gated
from ..loop.decoding import check_max_tokens
from ..programs.aio import AsyncStream, to_thread
from ..state import SequenceState
from .generator import Generator, Stream, prompt_state

__all__ = ["continuous", "ContinuousGenerator"]

Input = str | Sequence[str] | SequenceState | Sequence[SequenceState]


class ContinuousGenerator:
    """Wraps a generator so it takes and returns :class:`~continuum.SequenceState`.

    Call it with a prompt, a list of prompts, a state, or a list of states (stacked along the
    batch axis). The returned state keeps its KV cache, so feeding it (or a slice of it, or
    ``it + "more text"``) to any continuous generator computes only what the model has not seen.

    Example:
        >>> text_c = continuous(generate.text(model, samplers.greedy()))      # doctest: +SKIP
        >>> s = text_c("Review: great phone.", max_tokens=30)                 # doctest: +SKIP
        >>> s2 = continuous(generate.choice(model, ["Positive", "Negative"]))(s + "\\nSentiment: ")  # doctest: +SKIP
        >>> s2.value                                                           # doctest: +SKIP
        'Positive'
    """

    def __init__(self, generator: Generator):
        if not isinstance(generator, Generator):
            raise ContinuumTypeError(f"continuous() takes a generator from continuum.generate (e.g. "
                                     f"continuous(generate.text(model))), got {type(generator).__name__}")
        self.generator = generator

    def __repr__(self) -> str:
        return f"continuous({self.generator!r})"

    def _state(self, inputs: Input) -> SequenceState:
        if isinstance(inputs, SequenceState):
            state = inputs
        elif isinstance(inputs, (list, tuple)) and any(isinstance(s, SequenceState) for s in inputs):
            state = SequenceState.stack(inputs)  # names a non-state item
        else:  # no state in it, so text or not a prompt at all: from_prompts names what is wrong with a non-text prompt
            state = prompt_state(self.generator.model, cast("str | Sequence[str]", inputs))
        # The generator's model is the one that runs: a state of another model (same tokenizer) drops
        # that model's cache and is recomputed in one pass; another tokenizer raises TokenizerMismatch.
        return state.to_model(self.generator.model)

    @gated  # (continuum's own Python, few threads at once: no GIL convoy; released while waiting)
    def __call__(self, inputs: Input, max_tokens: int | None = None, stop_at: str | Sequence[str] | None = None,
                 rng: torch.Generator | None = None) -> SequenceState:
        """Generate from ``inputs`` and return the new state (the input is never modified)."""
        check_max_tokens(max_tokens)
        return self.generator._run(self._state(inputs), max_tokens, stop_at, rng)

    def stream(self, inputs: Input, max_tokens: int | None = None, stop_at: str | Sequence[str] | None = None,
               rng: torch.Generator | None = None) -> Stream:
        """Yield text chunks; once exhausted, ``stream.state`` is the new state."""
        check_max_tokens(max_tokens)
        state = self._state(inputs)
        samples = self.generator.sampler.samples
        shape = Generator._shape_for("x" if state.batch == 1 else ["x"] * state.batch, samples)
        return Stream(self.generator._steps(state, max_tokens, stop_at, rng, True), shape,
                      self.generator.sampler.is_beam_search, lambda s: s)

    async def acall(self, inputs: Input, max_tokens: int | None = None, stop_at: str | Sequence[str] | None = None,
                    rng: torch.Generator | None = None) -> SequenceState:
        """``await gen.acall(...)``: the same arguments and state as calling it, without blocking the event loop
        (run on a shared worker thread; concurrent calls share forwards; cancelling the task stops the call)."""
        return await to_thread(self, inputs, max_tokens, stop_at, rng)

    def astream(self, inputs: Input, max_tokens: int | None = None, stop_at: str | Sequence[str] | None = None,
                rng: torch.Generator | None = None) -> AsyncStream:
        """``async for chunk in gen.astream(...)``: the chunks of :meth:`stream`; then ``.state`` is the new state."""
        return AsyncStream(self.stream(inputs, max_tokens, stop_at, rng))


def continuous(generator: Generator) -> ContinuousGenerator:
    """Make ``generator`` take and return :class:`~continuum.SequenceState` (see :class:`ContinuousGenerator`)."""
    return ContinuousGenerator(generator)
