"""Reasoning: think freely, then answer under the generator's constraint (docs/reasoning.md).

A generator with ``reasoning=`` runs the decoding loop with a :class:`~continuum.guides.reasoning.ReasoningGuide`
around its constraint; this module resolves the markers, picks each row's starting phase from its
prompt, checks the budget against ``max_tokens``, and turns the loop's result into a state whose
``value`` is the answer alone and whose ``reasoning`` is the thought.

Markers are found as TOKEN IDS: the tokenizer's added tokens ``<think>``/``</think>`` (``reasoning=True``),
or the pair given (``reasoning=("<think>", "</think>")``) encoded canonically when the tokenizer
has no single token for them.

Example:
    >>> gen = generate.json(model, schema, reasoning=True, thinking_budget=64)   # doctest: +SKIP
    >>> s = continuous(gen)(prompt, max_tokens=256)                              # doctest: +SKIP
    >>> s.reasoning, s.value, s.finish_reasons                                   # doctest: +SKIP
    ('The user wants ...', {'name': 'Ann'}, [['thinking_budget']])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ReasoningError
from ..guides.reasoning import ANSWER, OPEN, SEP, THINK, Markers, ReasoningGuide

__all__ = ["Markers", "resolve_markers", "check_reasoning", "plan_budget", "reasoning_guide", "annotate",
           "MIN_ANSWER_TOKENS", "thought_texts", "reasoning_tokens", "step_texts", "Steps",
           "think_then"]

#: The room ``max_tokens`` must leave after a thought's budget and its markers (an explicit budget
#: larger than ``max_tokens - overhead - MIN_ANSWER_TOKENS`` is refused).
MIN_ANSWER_TOKENS = 8

_DEFAULT = ("<think>", "</think>")


def check_reasoning(reasoning: Any, thinking_budget: Any) -> None:
    """Validate the generator arguments (raises :class:`ReasoningError`)."""
    ok = reasoning in (False, True, None) or (
        isinstance(reasoning, (tuple, list)) and len(reasoning) == 2 and all(isinstance(m, str) and m for m in reasoning))
    if not ok:
        raise ReasoningError(f"reasoning must be False, True or a (start, end) marker pair such as ('<think>', '</think>'), "
                             f"got {reasoning!r}")
    if thinking_budget is not None:
        if isinstance(thinking_budget, bool) or not isinstance(thinking_budget, int) or thinking_budget < 0:
            raise ReasoningError(f"thinking_budget must be an int >= 0 (thought tokens) or None, got {thinking_budget!r}")
        if not reasoning:
            raise ReasoningError("thinking_budget needs reasoning: pass reasoning=True (or the marker pair) too")


def resolve_markers(tokenizer, reasoning: Any) -> Markers | None:
    """The markers of ``reasoning`` for ``tokenizer`` (a continuum Tokenizer), or None when off."""
    if not reasoning:
        return None
    start, end = _DEFAULT if reasoning is True else tuple(reasoning)
    added = {t: i for t in (start, end) if (i := tokenizer.added_token_id(t)) is not None}
    if reasoning is True and (start not in added or end not in added):
        raise ReasoningError(f"the tokenizer {tokenizer.name!r} has no {start!r}/{end!r} tokens: pass the marker pair "
                             f"its model writes, e.g. reasoning=('<think>', '</think>') (matched as their tokens)")

    def ids(text: str) -> tuple[int, ...]:
        if text in added:
            return (int(added[text]),)
        out = tuple(tokenizer.encode_special(text))
        if not out:
            raise ReasoningError(f"the reasoning marker {text!r} encodes to no token: pass markers the model writes")
        return out

    s, e = ids(start), ids(end)
    if s == e:
        raise ReasoningError(f"the reasoning markers must differ, got {start!r} and {end!r}")

    def after(marker: tuple[int, ...], text: str, sep: str) -> tuple[int, ...]:
        both = tuple(tokenizer.encode_special(text + sep))  # the template's newlines, as it tokenizes them
        return both[len(marker):] if both[:len(marker)] == marker else ()

    nl = tuple(tokenizer.encode_special("\n"))
    ends = frozenset(i for i, b in enumerate(tokenizer.vocab_bytes) if b is not None and b.endswith(b"\n"))
    return Markers(start=s, end=e, open_sep=after(s, start, "\n"), close_sep=after(e, end, "\n\n"),
                   start_text=start, end_text=end, newline=nl[0] if len(nl) == 1 else None, line_ends=ends)


def _find_last(ids: Sequence[int], marker: tuple[int, ...]) -> int:
    n = len(marker)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i:i + n]) == marker:
            return i
    return -1


def _find_first(ids: Sequence[int], marker: tuple[int, ...]) -> int:
    n = len(marker)
    return next((i for i in range(len(ids) - n + 1) if tuple(ids[i:i + n]) == marker), -1)


def initial_phase(markers: Markers, ids: Sequence[int], decode) -> tuple[str, int]:
    """Where a row starts: inside an open thought, after a closed one, or before it (forced open)."""
    s, e = _find_last(ids, markers.start), _find_last(ids, markers.end)
    if s > e:  # the prompt opened the thought (DeepSeek-R1's template): the model is inside it
        after = tuple(ids[s + len(markers.start):])
        sep = markers.open_sep
        if len(after) <= len(sep) and sep[:len(after)] == after:
            return OPEN, len(markers.start) + len(after)
        return THINK, int(ids[-1] in markers.line_ends)
    if e >= 0:  # closed just before the answer (enable_thinking=False, a prefilled thought): the constraint from token 0
        after = tuple(ids[e + len(markers.end):])
        sep = markers.close_sep
        if len(after) <= len(sep) and sep[:len(after)] == after:
            return SEP, len(after)
        if not decode(list(after)).strip():
            return ANSWER, 0
    return OPEN, 0  # no thought in this turn (an earlier turn's closed thought is history)


def plan_budget(markers: Markers, budget: int | None, max_tokens: int | None, phases: Sequence[tuple[str, int]]) -> int | None:
    """The thought budget a call runs with: ``budget`` (checked against ``max_tokens``), or, without
    one, what ``max_tokens`` leaves after the markers and a minimum answer (so the answer keeps room)."""
    if max_tokens is None or all(p[0] in (SEP, ANSWER) for p in phases):
        return budget
    room = max_tokens - markers.overhead - MIN_ANSWER_TOKENS
    if budget is None:
        return max(0, room)
    if budget > room:
        raise ReasoningError(f"thinking_budget={budget} leaves the answer no room: max_tokens={max_tokens} counts the "
                             f"thought, its {markers.overhead} marker tokens and the answer (at least {MIN_ANSWER_TOKENS}); "
                             f"raise max_tokens to {budget + markers.overhead + MIN_ANSWER_TOKENS} or more, or lower the "
                             f"budget to {max(room, 0)}")
    return budget


def reasoning_guide(state, inner, markers: Markers, budget: int | None, max_tokens: int | None, extra_eos=(),
                    stop_after: bool = False) -> ReasoningGuide:
    """The per-call guide for ``state``'s rows (all rows must start in the same phase)."""
    tok = state._model.tokenizer
    phases = [initial_phase(markers, ids, tok.decode) for ids, _ in state._real_rows()]
    if len(set(phases)) > 1:
        raise ReasoningError("the prompts of this call differ in whether their thought is open, closed or not started "
                             f"({sorted(set(p[0] for p in phases))}): generate them in separate calls")
    # not in a thought: the end of the sequence (the answer must follow) nor a second start marker
    banned = set(tok.eos_token_ids) | set(extra_eos) | (set(markers.start) if len(markers.start) == 1 else set())
    return ReasoningGuide(inner, markers, plan_budget(markers, budget, max_tokens, phases), initial=phases[0],
                          eos=sorted(banned - set(markers.end)), stop_after=stop_after)


def annotate(out, markers: Markers, guide: ReasoningGuide, text_kind: bool):
    """``out`` (the loop's state) with its last step split: ``starts`` at the answer, ``thoughts``
    per row ``(step start, thought start, thought end)`` in characters, ``finish`` ``thinking_budget``
    where the budget cut a row that then ended normally."""
    from ..state import LastStep, SequenceState

    last: LastStep = out._last_step()
    tok = out._model.tokenizer
    starts, thoughts, finish = [], [], list(last.finish or ("",) * out.rows)
    for r, (ids, lps) in enumerate(out._real_rows()):
        begin = last.starts[r]
        cut = len(ids)
        while cut > 0 and lps[cut - 1] == lps[cut - 1]:  # the trailing generated run (prompt tokens are NaN)
            cut -= 1
        chars = _Chars(tok, ids)
        gen_from = next((i for i in range(cut, len(ids)) if chars(i) >= begin), len(ids))
        # the thought's end: the first marker of the step (a free answer may write one again); none when the
        # prompt had closed the thought
        e = _find_first(ids[gen_from:], markers.end) if guide.initial[0] in (OPEN, THINK) else -1
        s = _find_last(ids[gen_from:e + gen_from if e >= 0 else len(ids)], markers.start)
        if s >= 0:
            first = gen_from + s + len(markers.start) + len(markers.open_sep)
        elif guide.initial[0] == OPEN:  # the prompt ended inside the opening (its newline forced here)
            first = gen_from + len(markers.start) + len(markers.open_sep) - guide.initial[1]
        else:
            first = gen_from
        t0 = max(chars(first), begin)
        if e < 0:  # the thought did not close (max_tokens, context, a stop string), or none was written
            inside = guide.initial[0] in (OPEN, THINK) or s >= 0
            t1 = last.ends[r] if inside else begin
            starts.append(t1)
            thoughts.append((begin, min(t0, t1), t1, len(ids) - gen_from if inside else 0))
            continue
        e += gen_from
        t1 = chars(e)
        answer = e + len(markers.end) + len(markers.close_sep)
        starts.append(min(last.ends[r], chars(answer)))
        thoughts.append((begin, min(t0, t1), t1, min(answer, len(ids)) - gen_from))
        if guide.budget is not None and e - first >= guide.budget and finish[r] in ("pattern", "eos"):
            finish[r] = "thinking_budget"
        elif text_kind and finish[r] == "pattern":
            finish[r] = "eos"  # (a free answer ends at EOS; the wrapper guide made it read "pattern")
    new = LastStep(kind=last.kind, starts=tuple(starts), ends=last.ends, complete=last.complete, parse=last.parse,
                   max_tokens=last.max_tokens, guide_key=last.guide_key, guide_states=last.guide_states,
                   finish=tuple(finish), marks=None, thoughts=tuple(thoughts))
    return SequenceState(model=out._model, ids=out._ids, mask=out._mask, logprobs=out._logprobs, weights=out._weights,
                         kv=out._kv, batch=out.batch, samples=out.samples, last=new)


class _Chars:
    """``chars(i)``: the length of the decoded text of ``ids[:i]`` (the character offset of token ``i``)."""

    def __init__(self, tok, ids):
        self.tok, self.ids, self.memo = tok, ids, {}

    def __call__(self, i: int) -> int:
        i = max(0, min(i, len(self.ids)))
        if i not in self.memo:
            self.memo[i] = len(self.tok.decode(self.ids[:i]))
        return self.memo[i]


def thought_texts(state) -> list[str]:
    """Per row, the thought of the last step (newlines around it stripped, as templates render it)."""
    out = state.reasoning
    return [out] if isinstance(out, str) else [x for row in out for x in row] if out and isinstance(out[0], list) else list(out)


def step_texts(state) -> list[str]:
    """Per row, the text the last step streamed: thought and answer with reasoning (special markers decode
    to nothing), else the step's output."""
    last, texts = state._last_step(), state.texts
    begins = [t[0] for t in last.thoughts] if last.thoughts is not None else last.starts
    return [t[b:e] for t, b, e in zip(texts, begins, last.ends)]


def reasoning_tokens(state) -> list[int]:
    """Per row, the tokens the last step spent thinking (markers and their newlines included)."""
    last = state._last_step()
    return [t[3] for t in last.thoughts] if last.thoughts is not None else [0] * state.rows


class Steps:
    """A reasoning call's steps (an iterator of loop ``Step``s returning the final state), with the
    reasoning guide: ``phases()`` says where each row is now (a server splits its stream with it)."""

    def __init__(self, steps, guide: ReasoningGuide, finish=None):
        self._steps, self.guide, self._finish = steps, guide, finish
        self._phases: list[str | None] | None = None

    def __iter__(self):
        return self

    def __next__(self):
        try:
            step = next(self._steps)
        except StopIteration as done:
            self._phases = None  # (the loop has ended: the guide no longer moves)
            value = done.value if self._finish is None else self._finish(done.value)
            raise StopIteration(value) from None
        self._phases = step.phases
        return step

    def close(self) -> None:
        self._steps.close()

    def phases(self) -> list[str | None]:
        """Each row's phase as of the last step passed on (read in the loop's thread, with that step's text: the loop
        may already be steps ahead); the guide's own once the loop has ended."""
        return self._phases if self._phases is not None else self.guide.phases()


def think_then(gen, state, max_tokens, rng, track_text: bool, extra_eos, answer) -> Steps:
    """Decode the thought alone (the row stops where the answer starts), then ``answer(state, max_tokens
    left)``'s steps after it: choice by scoring, and a ``stop_at`` that must apply to the answer only.
    One state, one last step (the answer's, with the thought's spans)."""
    from ..loop.decoding import Step, decode
    from ..state import LastStep, SequenceState

    guide = reasoning_guide(state, None, gen.markers, gen.thinking_budget, max_tokens, extra_eos, stop_after=True)

    def run():
        out = yield from decode(state, gen.sampler, guide=guide, max_tokens=max_tokens, rng=rng, kind=gen.kind,
                                parse=gen.parse, track_text=track_text, guidance=gen.guidance,
                                fast_forward=gen.fast_forward, extra_eos=extra_eos)
        thought = annotate(out, gen.markers, guide, False)
        t_last, t_real = thought._last_step(), thought._real_rows()
        if not all(t_last.complete):  # a thought that never closed: no answer after it
            return thought
        left = None if max_tokens is None else max(0, max_tokens - max(reasoning_tokens(thought)))
        prefix = [t[a[0]:] for t, a in zip(thought.texts, t_last.thoughts or ())]
        steps = answer(thought, left)
        while True:
            try:
                step = next(steps)
            except StopIteration as done:
                final = done.value
                break
            yield Step([p + t for p, t in zip(prefix, step.texts)] if step.texts and len(step.texts) == len(prefix)
                       else step.texts, step.reordered, guide.phases())  # (the thought's guide has stopped moving)
        last = final._last_step()
        src = [max(range(len(t_real)), key=lambda i: (_prefix_of(t_real[i][0], ids), -i)) for ids, _ in final._real_rows()]
        cut = [(t_last.finish or ())[i] == "thinking_budget" for i in src]
        finish = tuple("thinking_budget" if c and f in ("pattern", "eos") else f
                       for c, f in zip(cut, last.finish or ("pattern",) * final.rows))
        spans = t_last.thoughts or ((0, 0, 0, 0),) * len(t_real)
        new = LastStep(kind=last.kind, starts=last.starts, ends=last.ends, complete=last.complete, parse=last.parse,
                       max_tokens=max_tokens, guide_key=last.guide_key, guide_states=last.guide_states, finish=finish,
                       thoughts=tuple((spans[i][0], spans[i][1], spans[i][2], spans[i][3]) for i in src))
        return SequenceState(model=final._model, ids=final._ids, mask=final._mask, logprobs=final._logprobs,
                             weights=final._weights, kv=final._kv, batch=final.batch, samples=final.samples, last=new)

    return Steps(run(), guide)


def _prefix_of(prefix: Sequence[int], ids: Sequence[int]) -> int:
    """How long ``prefix`` is when it is a prefix of ``ids`` (-1 otherwise)."""
    return len(prefix) if len(prefix) <= len(ids) and list(ids[:len(prefix)]) == list(prefix) else -1
