"""Chat sessions on continuous states: a chat is a ``SequenceState`` plus its messages.

::

    messages ──apply_chat_template──▶ canonical token ids ──┐ longest common token prefix
    state (last reply, KV cache) ───────────────────────────┴─▶ cut there (cache kept), append the rest
                                                              ──▶ any generator ──▶ new state + reply message

Every reply continues the messages rendered by transformers' ``apply_chat_template``
(``add_generation_prompt=True``, or ``continue_final_message=True`` after :meth:`Chat.assistant`),
*template-exact*: the same text, every token outside the model's replies the canonical one, and the
model's earlier replies in the tokens it generated (a constrained or sampled reply is often not its
text's canonical split; `continuum/chat/reuse.py`), so a turn computes only the new messages. Templates
that rewrite history (Qwen3 drops earlier ``<think>`` blocks, Llama-3 and Mistral trim messages) are
why the state is *reconciled* with each new rendering by tokens instead of appending text: a turn
computes only the tokens after the common prefix, plus the generated ones.

The end of a turn is read from the template (a sentinel reply is rendered and what follows it is
the end-of-turn marker: ``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ``<end_of_turn>``). A text reply
stops there (or at the model's EOS); the marker is not kept: the next rendering closes the turn.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ChatTemplateError, ContinuumTypeError
from ..generate.continuous import ContinuousGenerator
from ..generate.generator import Generator
from ..loop.checks import stop_list as _stop_list
from ..models.tokenizer import check_encodable
from ..programs.aio import AsyncStream, to_thread
from ..state import SequenceState
from ..state.core import _NAN
from ..state.indexing import truncate
from .reasoning import check_chat_reasoning, reply_generator, template_kwargs_for, with_thoughts
from .reuse import common_prefix, own_tokens
from .stream import ChatStream
from .template import Renderer

__all__ = ["Chat", "ChatStream"]

_ROLES = ("system", "user", "assistant", "tool")

Message = dict


def _check_content(role: str, content: Any) -> str:
    if not isinstance(content, str):
        hint = " (decode bytes first)" if isinstance(content, (bytes, bytearray)) else (
            " (serialise it first, e.g. json.dumps(obj))" if isinstance(content, (dict, list)) else "")
        raise ContinuumTypeError(f"a {role} message's content must be a str, got {type(content).__name__}{hint}")
    check_encodable(content, f"the {role} message")  # else the tokenizer's TypeError would read as the template's
    return content


class Chat:
    """An immutable chat: messages, the chat template that renders them, and the state behind them.

    Args:
        model: a continuum model (``models.transformers(...)``).
        system: an optional first system message.
        template: the Jinja chat template (default: the tokenizer's ``chat_template``).
        tools: tool definitions (JSON schemas or functions) the template renders.
        template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).
        reasoning: the replies' default (None: each generator's own; True or a marker pair: think
            first; False: no thought); also sets the template's ``enable_thinking`` unless given.
        keep_reasoning: True keeps earlier thoughts in the rendered history (every turn reuses the
            whole cache); False (default) follows the template (docs/reasoning.md).
        thinking_budget: the replies' default thought budget.

    ``system/user/assistant/tool`` return a new chat with one more message (nothing is computed;
    the template is rendered to check it accepts them: a refusal raises :class:`ChatTemplateError`).
    :meth:`reply` generates the assistant turn with any generator. A chat has the rows of its
    state: ``multinomial(n)`` or ``beam_search(n)`` fork it, ``c[i]`` is row ``i``'s chat.

    Example:
        >>> c = Chat(model, system="You are terse.").user("Name three colors.")   # doctest: +SKIP
        >>> c = c.reply(generate.text(model, samplers.greedy()), max_tokens=30)  # doctest: +SKIP
        >>> c.value, c.finish_reason, c.state.cached_tokens                      # doctest: +SKIP
    """

    __slots__ = ("_setup", "_rows", "_state", "_recomputed")
    _setup: Renderer
    _rows: tuple[tuple[Message, ...], ...]
    _state: SequenceState | None
    _recomputed: list[int] | None

    def __init__(self, model, system: str | None = None, *, template: str | None = None,
                 tools: Sequence[Any] | None = None, template_kwargs: dict | None = None, reasoning: Any = None,
                 keep_reasoning: bool = False, thinking_budget: int | None = None):
        if not hasattr(model, "tokenizer") or not hasattr(model, "forward"):
            raise ContinuumTypeError(f"Chat takes a continuum model (models.transformers(...)), got {type(model).__name__}")
        if template is not None and not isinstance(template, str):
            raise ContinuumTypeError(f"template must be the Jinja text of a chat template, got {type(template).__name__}")
        if template is None and not model.tokenizer.chat_template:
            raise ChatTemplateError(f"the tokenizer {model.tokenizer.name!r} has no chat template: pass one, "
                                    f"Chat(model, template=jinja_text) (e.g. the chat_template of an instruct model)")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise ContinuumTypeError(f"template_kwargs must be a dict, got {type(template_kwargs).__name__}")
        check_chat_reasoning(reasoning, keep_reasoning, thinking_budget)
        kwargs = template_kwargs_for(template, model.tokenizer, dict(template_kwargs or {}), reasoning)
        setup = Renderer(model, template, list(tools) if tools is not None else None, kwargs, reasoning, keep_reasoning,
                         thinking_budget)
        self._init(setup, ((),), None)
        if system is not None:
            self._rows = self.system(system)._rows

    def _init(self, setup: Renderer, rows: tuple[tuple[Message, ...], ...], state: SequenceState | None) -> Chat:
        self._setup, self._rows, self._state, self._recomputed = setup, rows, state, None
        return self

    @classmethod
    def _make(cls, setup, rows, state) -> Chat:
        return cls.__new__(cls)._init(setup, rows, state)

    # ------------------------------------------------------------------ messages (nothing is computed)
    def message(self, role: str, content: str, **fields: Any) -> Chat:
        """A new chat with one more message (``fields``: extra keys such as ``tool_calls`` or ``name``)."""
        if role not in _ROLES:
            raise ChatTemplateError(f"unknown role {role!r}: use one of {list(_ROLES)}")
        msg = {"role": role, "content": _check_content(role, content), **copy.deepcopy(fields)}
        rows = tuple(r + (msg,) for r in self._rows)
        for r in rows:
            self._setup.render(r, tokenize=False, generation=False)  # the template's refusal, raised here
        return Chat._make(self._setup, rows, self._state)

    def system(self, content: str) -> Chat:
        """Append a system message."""
        return self.message("system", content)

    def user(self, content: str) -> Chat:
        """Append a user message."""
        return self.message("user", content)

    def assistant(self, content: str, **fields: Any) -> Chat:
        """Append an assistant message. Left last, it is a *prefill*: :meth:`reply` continues it."""
        return self.message("assistant", content, **fields)

    def tool(self, content: str, **fields: Any) -> Chat:
        """Append a tool result message (``fields``: e.g. ``name`` or ``tool_call_id``)."""
        return self.message("tool", content, **fields)

    # ------------------------------------------------------------------ replies
    def reply(self, generator: Generator | ContinuousGenerator, max_tokens: int | None = None,
              stop_at: str | Sequence[str] | None = None, rng: torch.Generator | None = None, *,
              reasoning: Any = None, thinking_budget: int | None = None) -> Chat:
        """The chat with the assistant's reply generated by ``generator`` (text, choice, regex, json, cfg).

        A text reply ends at the template's end-of-turn marker or the model's EOS (the marker is
        not part of the content); a constrained one when its constraint completes. ``max_tokens``,
        ``stop_at`` and ``rng`` are passed to the generator. ``reasoning`` / ``thinking_budget``
        override the chat's (and the generator's): the thought goes to the message's ``reasoning_content``.
        """
        turn = _Turn(self, generator, max_tokens, stop_at, reasoning, thinking_budget)
        steps = turn.generator._steps(turn.state, max_tokens, turn.stops, rng, False, extra_eos=turn.end_ids)
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return turn.finish(stop.value)

    def stream_reply(self, generator: Generator | ContinuousGenerator, max_tokens: int | None = None,
                     stop_at: str | Sequence[str] | None = None, rng: torch.Generator | None = None, *,
                     reasoning: Any = None, thinking_budget: int | None = None) -> ChatStream:
        """Like :meth:`reply`, but yields the reply's text as it is generated; then ``.chat`` is the new chat."""
        turn = _Turn(self, generator, max_tokens, stop_at, reasoning, thinking_budget)
        steps = turn.generator._steps(turn.state, max_tokens, turn.stops, rng, True, extra_eos=turn.end_ids)
        return ChatStream(turn, steps)

    async def areply(self, generator: Generator | ContinuousGenerator, max_tokens: int | None = None,
                     stop_at: str | Sequence[str] | None = None, rng: torch.Generator | None = None) -> Chat:
        """``await chat.areply(...)``: :meth:`reply` without blocking the event loop (concurrent replies share forwards)."""
        return await to_thread(self.reply, generator, max_tokens, stop_at, rng)

    def astream_reply(self, generator: Generator | ContinuousGenerator, max_tokens: int | None = None,
                      stop_at: str | Sequence[str] | None = None, rng: torch.Generator | None = None) -> AsyncStream:
        """``async for chunk in chat.astream_reply(...)``: :meth:`stream_reply`'s chunks; then ``.chat`` is the new chat."""
        return AsyncStream(self.stream_reply(generator, max_tokens, stop_at, rng))

    def with_state(self, state: SequenceState | None) -> Chat:
        """This chat's messages on ``state`` (e.g. a state loaded from a file, or another chat's): the
        next reply reconciles ``state`` with the rendered messages, so it reuses the cache of their
        longest common token prefix and recomputes the rest; any state of the model is valid."""
        if state is not None and not isinstance(state, SequenceState):
            raise ContinuumTypeError(f"with_state takes a SequenceState or None, got {type(state).__name__}")
        return Chat._make(self._setup, self._rows, state)

    def render(self, row: int = 0) -> str:
        """The prompt text a reply of row ``row`` would continue (the template's rendering)."""
        return self._setup.render(self._rows[row], tokenize=False, generation=True)

    # ------------------------------------------------------------------ reading
    @property
    def rows(self) -> int:
        return len(self._rows)

    @property
    def messages(self) -> list[Message] | list[list[Message]]:
        """The messages (copies): one list, or one list per row when the chat has several rows."""
        out = [copy.deepcopy(list(r)) for r in self._rows]
        return out[0] if len(out) == 1 else out

    @property
    def state(self) -> SequenceState | None:
        """The state of the last reply (tokens, KV cache, weights); ``None`` before the first reply."""
        return self._state

    def _reply_state(self) -> SequenceState:
        if self._state is None:
            raise ValueError("this chat has no reply yet: call chat.reply(generator) first")
        return self._state

    @property
    def value(self) -> Any:
        """The last reply's value: its text (text, regex, cfg), the option (choice) or the parsed JSON;
        a list over rows when there are several. A reply that continued an :meth:`assistant` prefill
        gives the continuation (the message holds prefill + continuation)."""
        return self._reply_state().value

    @property
    def finish_reason(self) -> str | list[str | None] | None:
        """Why the last reply ended: ``"eos"`` (end of turn or the model's EOS), ``"length"``,
        ``"stop"``, ``"pattern"`` (the constraint completed) or ``"context"``; a list over rows."""
        reasons = self._reply_state().finish_reasons
        flat: list[str | None] = [x for row in reasons for x in row] if reasons is not None else [None] * self.rows
        return flat[0] if len(flat) == 1 else flat

    @property
    def model(self):
        return self._setup.model

    @property
    def recomputed(self) -> int | list[int] | None:
        """Prompt tokens the last reply computed (not reused from the cache), per row; None before one."""
        r = self._recomputed
        return r[0] if r is not None and len(r) == 1 else r

    def __getitem__(self, i: int) -> Chat:
        """Row ``i``'s chat (its messages and its row of the state)."""
        if isinstance(i, bool) or not isinstance(i, int):
            raise ContinuumTypeError(f"a chat is indexed by a row number, got {type(i).__name__}")
        if not -self.rows <= i < self.rows:
            raise IndexError(f"row {i} out of range for a chat with {self.rows} row(s)")
        i %= self.rows
        if self.rows == 1:
            return self
        return Chat._make(self._setup, (self._rows[i],), self._state[0, i, :] if self._state is not None else None)

    def to_html(self) -> str:
        """The chat as HTML: turns (role, content), the last reply's tokens shaded by probability
        (samples or beams side by side); see :func:`continuum.display.chat_to_html`."""
        from ..display import chat_to_html

        st, rows = self._state, self._rows
        S = st.samples if st is not None else 1
        shared = st is not None and st.batch * S == self.rows and all(
            rows[i][:-1] == rows[i - i % S][:-1] for i in range(self.rows))
        if st is None or not shared:  # no reply yet, or samples whose histories differ: each row's turns as text
            return chat_to_html([list(r) for r in rows])
        # one conversation per batch row: its samples share the history; their replies come from the state
        return chat_to_html([list(rows[b * S]) for b in range(st.batch)], st)

    def _repr_html_(self) -> str:
        return self.to_html()

    def __repr__(self) -> str:
        msgs = self._rows[0]
        state = "no reply yet"
        if self._state is not None:
            n = len(self._state._real_rows()[0][0])
            state = f"{n} tokens, {self._state._cached_real()[0]} cached"
        head = f"Chat({len(msgs)} messages, rows={self.rows}, {state}"
        lines = [head + (", row 0 shown)" if self.rows > 1 else ")")]
        for m in msgs[-8:] if len(msgs) <= 8 else msgs[-7:]:
            text = m["content"] if len(m["content"]) <= 70 else m["content"][:40] + " ... " + m["content"][-25:]
            lines.append(f"  {m['role']}: {text!r}")
        if len(msgs) > 8:
            lines.insert(1, f"  ... ({len(msgs) - 7} earlier messages)")
        return "\n".join(lines)


class _Turn:
    """One reply in the making: the reconciled state going in, and how the result becomes a chat."""

    def __init__(self, chat: Chat, generator, max_tokens, stop_at, reasoning=None, thinking_budget=None):
        if isinstance(generator, ContinuousGenerator):
            generator = generator.generator
        if not isinstance(generator, Generator):
            raise ContinuumTypeError(f"reply takes a generator (e.g. generate.text(model)), got {type(generator).__name__}")
        check_chat_reasoning(reasoning, False, thinking_budget if reasoning is not None else None)
        s = chat._setup
        generator = reply_generator(generator, s.reasoning, reasoning, thinking_budget, s.thinking_budget)
        if any(not r for r in chat._rows):
            raise ChatTemplateError("a chat with no message cannot be replied to: add one, e.g. chat.user('Hi')")
        self.chat, self.generator, self.max_tokens = chat, generator, max_tokens
        setup = chat._setup
        self.prompts = [list(setup.render(r, tokenize=True, generation=True)) for r in chat._rows]
        state, continued = _reconcile(chat._state, self.prompts, setup.model)
        self.state = state.to_model(generator.model)
        self.recomputed = [len(p) - c for p, c in zip(continued, self.state._cached_real())]
        # a continued prefill: the rendering ends with it, or with it right-stripped (a trimming template)
        self.prefills: list[str | None] = []
        for r in chat._rows:
            last = r[-1]
            if last["role"] != "assistant":
                self.prefills.append(None)
                continue
            text = setup.render(r, tokenize=False, generation=True)
            self.prefills.append(last["content"] if text.endswith(last["content"]) else last["content"].rstrip())
        end_ids, self.markers = setup.end_of_turn()
        free = generator.guide is None and generator.kind == "text"  # a constrained reply ends with its constraint
        self.end_ids = end_ids if free else frozenset()
        self.markers = self.markers if free else ()
        self.stops = (_stop_list(stop_at) + list(self.markers)) or None  # (a bad stop_at raises here)

    def reply_texts(self, state: SequenceState) -> list[str]:
        last, texts = state._last_step(), state.texts
        return [t[s:e] for t, s, e in zip(texts, last.starts, last.ends)]

    def finish(self, state: SequenceState) -> Chat:
        """Cut end-of-turn markers a stop string caught, then record the reply messages."""
        done = state._last_step()  # the generator's result: it always has a last step
        finish = list(done.finish or ("",) * state.rows)
        if self.markers:
            texts, ends = state.texts, list(done.ends)
            for r, (t, e) in enumerate(zip(texts, ends)):
                marker = next((m for m in self.markers if finish[r] == "stop" and t[:e].endswith(m)), None)
                if marker is not None:
                    ends[r], finish[r] = e - len(marker), "eos"
            if ends != list(done.ends):
                cut = truncate(state, [e if e < len(t) else len(t) for e, t in zip(ends, texts)])
                last = cut._last_step().edited(finish=tuple(finish), complete=done.complete)
                state = SequenceState(model=cut._model, ids=cut._ids, mask=cut._mask, logprobs=cut._logprobs,
                                      weights=cut._weights, kv=cut._kv, batch=cut.batch, samples=cut.samples, last=last)
        replies = self.reply_texts(state)
        new_rows = []
        for text, (ids, _) in zip(replies, state._real_rows()):
            # the row it descends from (forks copy a row; beam search reorders rows and sorts them):
            # the one whose prompt it continues
            src = max(range(len(self.prompts)), key=lambda i: (common_prefix(ids, self.prompts[i]), -i))
            msgs, pre = self.chat._rows[src], self.prefills[src]
            if pre is None:
                new_rows.append(msgs + ({"role": "assistant", "content": text},))
            else:
                new_rows.append(msgs[:-1] + ({**msgs[-1], "content": pre + text},))
        out = Chat._make(self.chat._setup, with_thoughts(tuple(new_rows), state), state)
        out._recomputed = self.recomputed
        return out


def _reconcile(state: SequenceState | None, prompts: list[list[int]], model) -> tuple[SequenceState, list[list[int]]]:
    """A state holding ``prompts`` (one per row) that keeps ``state``'s cache over their longest common
    token prefix: each row is cut there and the rest of its prompt appended (uncached). A reply of the
    state rendered unchanged keeps the model's own tokens (:func:`continuum.chat.reuse.own_tokens`), so
    each row continues its own prompt: they are returned with the state. Weights keep the log-probs of
    the generated tokens inside the common prefix."""
    if state is None:
        rows = [list(p) for p in prompts]
        return SequenceState._from_rows(model, rows, [[_NAN] * len(r) for r in rows], torch.zeros(len(rows)),
                                        1, len(rows), None), rows
    real, cached = state._real_rows(), state._cached_real()
    if len(prompts) == 1 and state.rows > 1:
        prompts = prompts * state.rows
    keep, tails, weights, continued = [], [], [], []
    for r, new in enumerate(prompts):
        ids, lps = real[r]
        new = own_tokens(model.tokenizer, ids, lps, new)  # the replies keep the model's tokens
        continued.append(new)
        p = common_prefix(ids, new)
        c = min(p, cached[r])
        keep.append(c)
        tails.append((new[c:], lps[c:p] + [_NAN] * (len(new) - p)))
        weights.append(math.fsum(x for x in lps[:p] if x == x))
    return state._rebuild(keep, tails, torch.tensor(weights, dtype=state._weights.dtype), None), continued
