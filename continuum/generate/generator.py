"""``Generator``: one callable per (model, constraint, sampler), built on the decoding loop."""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import ContinuumTypeError, GeneratorArgumentError, KVCacheFullError, ReasoningError, StaleWindowError
from ..guides import Guide
from ..guides.reasoning import OPEN, THINK, Markers
from ..loop import coalesce
from ..loop.arrivals import gated
from ..loop.cfg import Guidance
from ..loop.decoding import Step, check_max_tokens, check_rng, decode, recompute_stale
from ..loop.setup import recompute_all, recompute_costly
from ..programs import lockstep
from ..programs.aio import AsyncStream, to_thread
from ..samplers import Sampler, multinomial
from ..speculate import check_speculator
from ..state import SequenceState, deferred
from .reasoning import Steps, annotate, check_reasoning, reasoning_guide, resolve_markers, step_texts, think_then

__all__ = ["Generator", "ChoiceGenerator", "Stream", "prompt_state"]

STALE_RETRIES = 3  # a call found stale reruns at most this often (Generator._run_alone)

Prompt = str | Sequence[str]


class Stream:
    """An iterator of text chunks; after it is exhausted, :attr:`state` holds the final state.

    Chunks are shaped like the generator's output: a ``str`` for one prompt and one sample, a
    list (per prompt) otherwise, and a list of lists for several prompts and samples. Beam search
    reorders beams at every step, so it streams one chunk: the final texts.
    """

    def __init__(self, steps: Iterator[Step], shape: Callable[[list[str]], Any], beams: bool,
                 finalize: Callable[[SequenceState], Any]):
        self._steps, self._shape, self._beams, self._finalize = steps, shape, beams, finalize
        self._state: SequenceState | None = None
        self._emitted: list[str] | None = None
        self._iter = Stream._run(weakref.proxy(self))  # (no cycle: dropping the stream closes its loop at once)
        self._busy = threading.Lock()

    def __iter__(self) -> Stream:
        return self

    def __next__(self):
        # A stream is one decoding loop: it belongs to one thread at a time (generators and
        # models are shared freely; see docs/generators.md#threads).
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this stream is being iterated by another thread: a stream belongs to one thread; "
                               "start one stream per thread (the generator and the model can be shared)")
        try:
            return next(self._iter)
        finally:
            self._busy.release()

    def _run(self):
        gen = self._steps
        while True:
            try:
                step = next(gen)
            except StopIteration as stop:
                self._state = stop.value
                break
            if self._beams or step.texts is None:
                continue
            emitted = self._emitted or [""] * len(step.texts)
            chunks = [t[len(e):] if t.startswith(e) else t for t, e in zip(step.texts, emitted)]
            self._emitted = step.texts
            if any(chunks):
                yield self._shape(chunks)
        final = _streamed(self._state)
        flat = final if isinstance(final, list) else [final]
        if flat and isinstance(flat[0], list):
            flat = [x for row in flat for x in row]
        emitted = self._emitted or [""] * len(flat)
        rest = [f[len(e):] if f.startswith(e) else f for f, e in zip(flat, emitted)]
        if self._beams or any(rest):  # the tail held back (partial characters) or cut at a stop string
            yield self._shape(rest)

    @property
    def state(self) -> SequenceState:
        """The final state (available once the stream is exhausted)."""
        if self._state is None:
            raise RuntimeError("the stream is not finished yet: iterate over it first")
        return self._state

    @property
    def result(self):
        """The final value, as the (non-streaming) generator call would return it."""
        return self._finalize(self.state)


def prompt_state(model, prompts: Prompt) -> SequenceState:
    """The state of ``prompts``; in a ``run_batch`` program, one prompt is tokenized when first read, or with every
    other instance's by the joint call that stacks them (``state/deferred.Prompt``)."""
    if isinstance(prompts, str) and lockstep.current() is not None:
        return deferred.prompt(model, prompts)
    return SequenceState.from_prompts(model, prompts)


def _streamed(state: SequenceState):
    """The text a stream of the last step emits, shaped like ``last_text`` (with reasoning: thought and answer)."""
    return state._shape_output(step_texts(state))


class Generator:
    """A reusable generator: ``gen(prompts, max_tokens=None, stop_at=None, rng=None)``.

    Calls never share mutable state, so a generator can be called again, and from several
    threads at once (give each call its own ``rng`` for reproducible sampling; see
    ``docs/generators.md#threads``).

    ``exact``: True when the constraint is enforced exactly while generating; a JSON generator
    whose schema was approximated (``on_unsupported="approximate"``) has ``exact = False`` and lists
    the keywords it does not enforce in ``not_enforced`` (its outputs are still validated).
    """

    exact: bool = True
    not_enforced: tuple = ()
    markers: Markers | None = None  # reasoning markers (continuum.generate.reasoning), None when off

    def __init__(self, model, sampler: Sampler | None = None, guide: Guide | None = None, *, kind: str = "text",
                 parse: Callable[[str], Any] | None = None, description: str = "", guidance: Guidance | None = None,
                 fast_forward: bool = True, token_healing: bool = False, reasoning: Any = False,
                 thinking_budget: int | None = None, speculate: Any = None):
        self.model = model
        self.sampler = sampler if sampler is not None else multinomial()
        if not isinstance(self.sampler, Sampler):
            raise ContinuumTypeError(f"sampler must be a continuum sampler (e.g. samplers.greedy()), "
                                     f"got {type(sampler).__name__}")
        self.guide, self.kind, self.parse, self.description = guide, kind, parse, description
        self.guidance = guidance  # classifier-free guidance settings, None when guidance_scale == 1
        if not isinstance(fast_forward, bool):
            raise GeneratorArgumentError(f"fast_forward must be True or False, got {fast_forward!r}")
        if not isinstance(token_healing, bool):
            raise GeneratorArgumentError(f"token_healing must be True or False, got {token_healing!r}")
        self.fast_forward, self.token_healing = fast_forward, token_healing
        self.speculate = check_speculator(speculate, self.sampler, model)
        self._set_reasoning(reasoning, thinking_budget)

    def _set_reasoning(self, reasoning: Any, thinking_budget: int | None) -> None:
        check_reasoning(reasoning, thinking_budget)
        if reasoning and self.token_healing:
            raise ReasoningError("token_healing does not combine with reasoning (the first token opens the thought): "
                                 "drop one of them")
        self.reasoning, self.thinking_budget = reasoning or False, thinking_budget
        self.markers = resolve_markers(self.model.tokenizer, reasoning)

    def with_reasoning(self, reasoning: Any = True, thinking_budget: int | None = None) -> Generator:
        """A copy of this generator that thinks first (``reasoning=False``: one that does not); see docs/reasoning.md.

        Example:
            >>> gen.with_reasoning(True, thinking_budget=32)("Q: ...", max_tokens=96)   # doctest: +SKIP
        """
        out = copy.copy(self)
        out._set_reasoning(reasoning, thinking_budget)
        return out

    def __repr__(self) -> str:
        what = f", {self.description}" if self.description else ""
        if self.guidance is not None:
            what += f", guidance_scale={self.guidance.scale:g}"
        return f"generate.{self.kind}({self.model!r}{what}, sampler={self.sampler!r})"

    # the plumbing shared with continuous()
    def _steps(self, state: SequenceState, max_tokens, stop_at, rng, track_text: bool, extra_eos: frozenset = frozenset()):
        if getattr(self.model, "runs_calls", False):  # models.remote: the whole call runs on the server
            return self.model.call_steps(self, state, max_tokens, stop_at, rng, track_text)
        if self.markers is not None:  # think first: the constraint wrapped (guides.reasoning), the result split
            guide = reasoning_guide(state, self.guide, self.markers, self.thinking_budget, max_tokens, extra_eos)
            if stop_at is not None and guide.initial[0] in (OPEN, THINK):  # stop strings: in the answer only
                return think_then(self, state, max_tokens, rng, track_text, extra_eos, lambda st, left: decode(
                    st, self.sampler, guide=self.guide, max_tokens=left, stop_at=stop_at, rng=rng, kind=self.kind,
                    parse=self.parse, track_text=track_text, guidance=self.guidance, fast_forward=self.fast_forward,
                    extra_eos=extra_eos, speculate=self.speculate))
            steps = decode(state, self.sampler, guide=guide, max_tokens=max_tokens, rng=rng,
                           kind=self.kind, parse=self.parse, track_text=track_text, guidance=self.guidance,
                           fast_forward=self.fast_forward, extra_eos=extra_eos, speculate=self.speculate)
            markers, text_kind = self.markers, self.guide is None
            return Steps(steps, guide, lambda out: annotate(out, markers, guide, text_kind))
        return decode(state, self.sampler, guide=self.guide, max_tokens=max_tokens, stop_at=stop_at, rng=rng,
                      kind=self.kind, parse=self.parse, track_text=track_text, guidance=self.guidance,
                      fast_forward=self.fast_forward, token_healing=self.token_healing, extra_eos=extra_eos,
                      speculate=self.speculate)

    def _run(self, state: SequenceState, max_tokens, stop_at, rng) -> SequenceState:
        key = coalesce.key_of(self, state, max_tokens, stop_at, rng)
        instance = lockstep.current()
        if instance is not None:  # a run_batch program: parked until the call ran, jointly with its cohort if it has one
            return instance.call(key, self, state, lambda s: self._run_alone(s, max_tokens, stop_at, rng))
        if key is not None:  # a program on its own thread: run as one call with the same calls arriving meanwhile
            return coalesce.run(key, self, state, lambda s: self._run_alone(s, max_tokens, stop_at, rng))
        return self._run_alone(state, max_tokens, stop_at, rng)

    def _run_alone(self, state: SequenceState, max_tokens, stop_at, rng) -> SequenceState:
        drawn = rng.get_state() if isinstance(rng, torch.Generator) else None  # (a bad rng: refused in the setup)
        for attempt in range(STALE_RETRIES + 1):
            gen = self._steps(state, max_tokens, stop_at, rng, False)
            try:
                while True:
                    next(gen)
            except StopIteration as stop:
                return stop.value
            except StaleWindowError:
                # (llama.cpp: another call's decode took window cells of this state's rows after this call's setup
                # found them there; those rows are computed again from their tokens, the draws from the same seed.
                # A recomputed row is safe from then on (its view ends its own sequence). Found stale a second time,
                # every row is computed again: any cached row whose view ends behind its sequence's end may lose
                # its cells to a concurrent call at the next step, whole at each retry's setup (the long oracle,
                # window-8 GGUF: three concurrent calls refused after their retries, about one run in ten).)
                fresh = recompute_stale(state) if attempt == 0 else recompute_all(state)
                if attempt == STALE_RETRIES or (attempt and fresh is state):
                    raise
            except KVCacheFullError:
                # (refused for room while running alone: rows whose cache takes more cells to bring back than to
                # compute, a hybrid's or a sliding window's short view of a long spilled state, are computed from
                # their tokens instead; the stress driver: 2-row calls on a 256-cell LFM2 pool)
                fresh = recompute_costly(state)
                if fresh is state:  # (none costly: then every row to be brought back, whose fork family may
                    fresh = recompute_costly(state, spilled=True)  # restore apart where it was priced as one)
                if attempt == STALE_RETRIES or fresh is state:
                    raise
            if drawn is not None:
                rng.set_state(drawn)
            state = fresh
        raise AssertionError("unreachable")

    def _prompt_state(self, prompts: Prompt) -> SequenceState:
        return prompt_state(self.model, prompts)

    @staticmethod
    def _shape_for(prompts: Prompt, samples: int) -> Callable[[list[str]], Any]:
        single = isinstance(prompts, str)

        def shape(flat: list[str]):
            if samples == 1:
                return flat[0] if single else flat
            nested = [flat[i:i + samples] for i in range(0, len(flat), samples)]
            return nested[0] if single else nested

        return shape

    def _value(self, prompts: Prompt, state: SequenceState):
        value = state.value
        if isinstance(prompts, str) or state.batch != 1:
            return value
        return [value]  # a list of one prompt gives a list

    @gated  # (continuum's own Python, few threads at once: no GIL convoy; released while waiting)
    def __call__(self, prompts: Prompt, max_tokens: int | None = None, stop_at: str | Sequence[str] | None = None,
                 rng: torch.Generator | None = None):
        """Generate for one prompt (returns a value) or a list of prompts (returns a list).

        With several samples or beams, each prompt gets a list of values (beams best first).
        """
        check_max_tokens(max_tokens)
        state = self._run(self._prompt_state(prompts), max_tokens, stop_at, rng)
        return self._value(prompts, state)

    def stream(self, prompts: Prompt, max_tokens: int | None = None, stop_at: str | Sequence[str] | None = None,
               rng: torch.Generator | None = None) -> Stream:
        """Like calling the generator, but yields text chunks as they are generated."""
        check_max_tokens(max_tokens)
        state = self._prompt_state(prompts)
        return Stream(self._steps(state, max_tokens, stop_at, rng, True), self._shape_for(prompts, self.sampler.samples),
                      self.sampler.is_beam_search, lambda s: self._value(prompts, s))

    # asyncio (continuum.programs.aio): the blocking call on a shared worker thread; concurrent calls share forwards
    async def acall(self, prompts: Prompt, max_tokens: int | None = None, stop_at: str | Sequence[str] | None = None,
                    rng: torch.Generator | None = None):
        """``await gen.acall(...)``: the same arguments and result as ``gen(...)``, without blocking the event loop.

        Cancelling the awaiting task stops the call at its next decoding step."""
        return await to_thread(self, prompts, max_tokens, stop_at, rng)

    def astream(self, prompts: Prompt, max_tokens: int | None = None, stop_at: str | Sequence[str] | None = None,
                rng: torch.Generator | None = None) -> AsyncStream:
        """``async for chunk in gen.astream(...)``: the chunks of :meth:`stream`; leaving the loop early stops it."""
        return AsyncStream(self.stream(prompts, max_tokens, stop_at, rng))


class ChoiceGenerator(Generator):
    """``generate.choice`` with ``method="exact"`` or ``"mean"``: options scored in one forward pass."""

    def __init__(self, model, options: list[str], sampler: Sampler | None = None, *, method: str = "exact",
                 guidance: Guidance | None = None, token_healing: bool = False, reasoning: Any = False,
                 thinking_budget: int | None = None):
        super().__init__(model, sampler, kind="choice", description=repr(options), guidance=guidance,
                         token_healing=token_healing, reasoning=reasoning, thinking_budget=thinking_budget)
        self.options, self.method = options, method

    def _steps(self, state: SequenceState, max_tokens, stop_at, rng, track_text: bool, extra_eos: frozenset = frozenset()):
        if getattr(self.model, "runs_calls", False):  # models.remote: the whole call runs on the server
            return self.model.call_steps(self, state, max_tokens, stop_at, rng, track_text)
        if max_tokens == 0:  # prefill only, like every generator (options end themselves: extra_eos is moot)
            return super()._steps(state, max_tokens, stop_at, rng, track_text)
        from ..loop.scoring import choose

        check_rng(rng)
        if self.markers is not None:  # decode the thought first, then score the options after it
            return think_then(self, state, max_tokens, rng, track_text, extra_eos, lambda st, left: choose(
                st, self.options, self.sampler, method=self.method, rng=rng, guidance=self.guidance))
        return choose(state, self.options, self.sampler, method=self.method, rng=rng, guidance=self.guidance,
                      token_healing=self.token_healing)
