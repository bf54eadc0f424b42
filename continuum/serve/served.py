"""The model side of the server: OpenAI messages -> ``Chat``, request options -> a generator, a reply.

Everything here is a plain client of the library: messages are rendered by ``continuum.chat.Chat``
(the model's chat template), constrained replies use ``generate.json`` (strict ``json_schema``, tool
arguments under each tool's parameter schema), and a continued conversation is a ``Chat`` on the
stored state (``Chat.with_state``), which reuses the cache of what did not change.

Tool calls are generated as the JSON object ``{"name": ..., "arguments": {...}}`` (the shape most
templates render, e.g. Qwen's ``<tool_call>`` blocks), under a schema that allows exactly the
offered tools and each tool's parameters: ``required`` and a named function generate it at once;
``auto`` generates text that stops at the template's tool-call marker (read from the template, as
the end-of-turn marker is) and, when the model writes it, continues with the constrained call.
Calls run in the caller's thread: concurrent requests run in worker threads, and the model's engine
runs all their calls in one step (docs/scheduler.md).
"""

from __future__ import annotations

import json as _json
import logging
import math
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import generate, samplers
from ..chat.reasoning import template_kwargs_for
from ..chat.session import Chat
from ..errors import ContinuumError
from ..generate.reasoning import MIN_ANSWER_TOKENS, reasoning_tokens, resolve_markers
from ..samplers import Sampler
from ..speculate import lookup as speculate_lookup
from ..state import SequenceState
from .closing import closing
from .either import Either, read_trigger
from .messages import new_id, template_message, tool_call_schema
from .queue import ReplyQueue
from .reasoning import Splitter
from .tokens import Recording as _Recording
from .tokens import common_prefix, generated_count, prediction_tokens, row_tokens, safe_length

logger = logging.getLogger("continuum.serve")

__all__ = ["Cancelled", "ServedModel", "Plan", "Reply", "RowReply", "Sampling"]



class Cancelled(Exception):
    """The client went away: the reply stopped (the decoding loop was left, its rows freed)."""


@dataclass
class Sampling:
    """How to draw tokens (OpenAI's names): temperature 0 is greedy."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int = 1
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    top_logprobs: int | None = None  # None: no log-probs; k >= 0: the chosen token's and the k best

    def sampler(self) -> Sampler:
        if self.temperature == 0:
            return samplers.greedy() if self.n == 1 else samplers.multinomial(self.n, temperature=0)
        return samplers.multinomial(self.n, temperature=self.temperature, top_p=self.top_p)

    def rng(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed if self.seed is not None else secrets.randbits(63))


@dataclass
class Plan:
    """What the reply is: free text, JSON under a schema, or tool calls."""

    mode: str = "text"  # "text" | "json" | "tools"
    schema: dict | None = None
    strict: bool = False
    tools: list[dict] = field(default_factory=list)  # [{"name", "description", "parameters"}]
    tool_choice: str = "auto"  # "auto" | "required" | a tool's name
    reasoning: Any = None  # None: as the template does; True: think first, then the above; False: no thought
    thinking_budget: int | None = None
    soft_budget: bool = False  # a budget from a reasoning effort: capped to what max_tokens leaves, not refused


@dataclass
class RowReply:
    """One row (choice) of a reply."""

    content: str
    tool_calls: list[dict]  # [{"id", "name", "arguments" (a JSON string)}]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None
    chat: Chat  # the conversation after this row's reply (its state included)
    reasoning: str | None = None  # the thought (None: the reply did not reason)
    reasoning_tokens: int = 0

    def message(self) -> dict:
        """The assistant message as a conversation stores it (OpenAI's shape)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:  # the template decides whether later turns render it (Qwen3 drops it)
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in self.tool_calls]
        return msg


@dataclass
class Reply:
    rows: list[RowReply]
    prompt_tokens: int
    cached_tokens: int
    predictions: dict[str, int] = field(default_factory=dict)  # drafted tokens kept and rejected (prediction_tokens)

    @property
    def completion_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


def _reply_of(c: Chat) -> tuple[SequenceState, dict, str]:
    """A one-row chat after a reply: its state, its last message and why the reply ended."""
    state, msgs, reason = c.state, c.messages, c.finish_reason
    assert state is not None and isinstance(msgs[-1], dict) and isinstance(reason, str)
    return state, msgs[-1], reason


def _finish(reason: str | None) -> str:
    return "length" if reason in ("length", "context") else "stop"


class ServedModel:
    """The model as the server serves it: its chat template, and the generators built for requests (cached by their
    settings). (Not the model's own engine, ``continuum.loop.engine``, which runs every call's steps.)"""

    def __init__(self, model, template: str | None = None, *, max_string_length: int | None = None,
                 reasoning: bool = False, bounds: Any = "default", max_queue: int | None = None,
                 speculate: str | None = None):
        self.model, self.template, self.max_string_length = model, template, max_string_length
        self.speculator = speculate_lookup() if speculate == "lookup" else None  # (--speculate: text and JSON replies)
        self.queue = ReplyQueue(max_queue, lambda: self.model.engine.waiting_calls())  # (--max-queue: queue.py)
        self.bounds = bounds  # generate.json's bounds= for every structured output (numbers within int64...)
        self.reasoning = reasoning  # `continuum serve --reasoning`: requests think unless they say otherwise
        if reasoning:  # the markers must exist: fail at start, not on every request
            resolve_markers(model.tokenizer, True)
        self._generators: OrderedDict[tuple, Any] = OrderedDict()  # generators, and Either's
        self._lock = threading.Lock()
        self._trigger: str | None = None
        self._no_automaton: set[str] = set()  # tool-call schemas outlines-core does not compile exactly

    # ------------------------------------------------------------------ building
    def chat(self, messages: list[dict], tools: list[dict] | None = None, state: SequenceState | None = None,
             template_kwargs: dict | None = None, reasoning: Any = None) -> Chat:
        """The conversation as a ``Chat`` (template messages), on ``state`` when one continues it;
        ``reasoning`` (a request's) sets the template's thinking switch unless ``template_kwargs`` does."""
        spec = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}}
                for t in tools] if tools else None
        kwargs = template_kwargs_for(self.template, self.model.tokenizer, template_kwargs or {}, reasoning)
        c = Chat(self.model, template=self.template, tools=spec, template_kwargs=kwargs)
        for m in messages:
            tm = template_message(m)
            role, content = tm.pop("role"), tm.pop("content")
            c = c.message(role, content, **tm)
        return c.with_state(state)

    def generator(self, kind: str, schema: dict | None, strict: bool, sampling: Sampling, record: bool,
                  compact: bool = False, backend: str = "auto"):
        """A ``generate.text``/``generate.json`` generator for these settings, and the log-prob recorder
        when ``record`` (then a fresh generator: the recorder belongs to one request). ``compact``: JSON
        without whitespace (tool calls: keys and punctuation are then forced tokens, computed in one pass)."""
        sampler = sampling.sampler()
        recorder = _Recording(sampler, sampling.top_logprobs or 0) if record else None
        key = (kind, _json.dumps(schema, sort_keys=True) if schema is not None else None, strict, repr(sampler), compact, backend)
        if recorder is None:
            with self._lock:
                hit = self._generators.get(key)
                if hit is not None:
                    self._generators.move_to_end(key)
                    return hit, None
        use = recorder or sampler
        spec = self.speculator if recorder is None else None  # (recorded log-probs: one token per step)
        if kind == "text":
            gen = generate.text(self.model, use, speculate=spec)
        else:  # one token per step when log-probs are recorded, so steps and tokens align
            gen = generate.json(self.model, schema, use, on_unsupported="raise" if strict else "approximate",
                                additional_properties=schema == {"type": "object"}, max_string_length=self.max_string_length,
                                bounds=self.bounds,
                                whitespace_pattern="" if compact else r"[ ]?",
                                fast_forward=recorder is None, backend=backend, speculate=spec)
        if recorder is None:
            with self._lock:
                self._generators[key] = gen
                while len(self._generators) > 64:
                    self._generators.popitem(last=False)
        return gen, recorder

    def call_generator(self, schema: dict, sampling: Sampling, record: bool, budget: int | None):
        """The generator of a tool call under ``schema``. With a ``budget``, an outlines-core automaton when
        the schema compiles to one exactly, steered to close within the budget (``closing.py``); else llguidance's."""
        key = _json.dumps(schema, sort_keys=True)
        if budget is not None and key not in self._no_automaton:
            try:
                gen, rec = self.generator("json", schema, True, sampling, record, compact=True, backend="outlines")
                if getattr(gen, "exact", False):
                    return closing(gen, budget), rec
                self._no_automaton.add(key)
            except ContinuumError as exc:  # not expressible as an automaton (or too large to compile): not retried
                logger.debug("tool call schema not compiled by outlines-core (%s): not steered to close", exc)
                self._no_automaton.add(key)
        return self.generator("json", schema, True, sampling, record, compact=True)

    def either(self, plan: Plan, sampling: Sampling, record: bool) -> tuple[Either, _Recording | None]:
        """The call-or-answer generator of ``plan`` (tools in "auto" and a JSON format: serve/either.py)."""
        sampler = sampling.sampler()
        rec = _Recording(sampler, sampling.top_logprobs or 0) if record else None
        key = ("either", _json.dumps([plan.tools, plan.schema], sort_keys=True), plan.strict, repr(sampler))
        with self._lock:
            hit = self._generators.get(key) if rec is None else None
        if hit is None:
            hit = Either.build(self.model, plan.tools, plan.schema or {}, plan.strict, self.tool_trigger(), rec or sampler,
                               max_string_length=self.max_string_length, bounds=self.bounds, fast_forward=rec is None)
            if rec is None:
                with self._lock:
                    self._generators[key] = hit
        return hit, rec

    def check_schema(self, schema: dict, strict: bool) -> None:
        """Compile a schema now (refused schemas are 400s before anything streams)."""
        self.generator("json", schema, strict, Sampling(temperature=0), False)

    def tool_trigger(self) -> str:
        """The text a template puts before a tool call's JSON (``<tool_call>`` for Qwen), read by rendering one."""
        if self._trigger is None:
            self._trigger = read_trigger(self.model.tokenizer, self.template)
        return self._trigger

    # ------------------------------------------------------------------ replying
    def reply(self, chat: Chat, plan: Plan, sampling: Sampling, on_delta: Callable[[int, str], None] | None = None,
              cancelled: Callable[[], bool] = lambda: False,
              on_reasoning: Callable[[int, str], None] | None = None) -> Reply:
        """Generate the assistant turn of ``chat``; ``on_delta(row, text)`` receives streamed text,
        ``on_reasoning(row, text)`` the streamed thought."""
        with self.queue.generation() as g:
            reply = self._reply(chat, plan, sampling, on_delta, cancelled, on_reasoning)
            g.prompt_tokens, g.generation_tokens, g.cached_tokens = \
                reply.prompt_tokens, reply.completion_tokens, reply.cached_tokens
            return reply

    @property
    def active(self) -> int:
        """Replies being generated now."""
        return self.queue.active

    def _reply(self, chat: Chat, plan: Plan, sampling: Sampling, on_delta, cancelled, on_reasoning=None) -> Reply:
        prev = chat.state
        rng = sampling.rng()
        record = sampling.top_logprobs is not None
        trigger = None
        stops: list[str] = []
        if plan.mode == "tools":  # a tool call is sent whole (in "auto", the marker may come late in the text)
            on_delta = None
        either = None
        if plan.mode == "json":
            gen, rec = self.generator("json", plan.schema, plan.strict, sampling, record)
        elif plan.mode == "tools" and plan.tool_choice == "auto" and plan.schema is not None:  # a call or a formatted answer
            either, rec = self.either(plan, sampling, record)
            gen = either.generator
        elif plan.mode == "tools" and plan.tool_choice != "auto":
            only = None if plan.tool_choice == "required" else plan.tool_choice
            gen, rec = self.call_generator(tool_call_schema(plan.tools, only), sampling, record, sampling.max_tokens)
        else:
            gen, rec = self.generator("text", None, False, sampling, record)
            stops = list(sampling.stop)
            if plan.mode == "tools":  # auto: text until the template's tool-call marker
                trigger = self.tool_trigger()
                stops.append(trigger)
        if plan.reasoning:  # think first; the format, the schema or the tool call applies after the thought
            budget = plan.thinking_budget
            if plan.soft_budget and budget is not None and sampling.max_tokens is not None:
                budget = min(budget, max(0, sampling.max_tokens - gen.with_reasoning(True).markers.overhead - MIN_ANSWER_TOKENS))
            gen = gen.with_reasoning(True, budget)
        first = self._run(chat, gen, sampling.max_tokens, stops, rng, on_delta, cancelled, on_reasoning)
        assert first.state is not None
        prompt_tokens, cached = self._usage(prev, first.state)
        rows = []
        for r in range(first.rows):
            c = first[r]
            state, last, reason = _reply_of(c)  # a row's chat holds that row alone
            thought = (state.reasoning, reasoning_tokens(state)[0]) if plan.reasoning else (None, 0)
            ids, lps = row_tokens(state, 0)
            content = last["content"]
            calls: list[dict] = []
            finish = _finish(reason)
            cut = next((x for x in sampling.stop if reason == "stop" and content.endswith(x)), None)
            if cut is not None:  # OpenAI's replies end before the stop sequence (the state keeps it)
                content = content[: -len(cut)]
            if plan.mode == "json" and reason in ("pattern", "eos", "thinking_budget"):
                _ = c.value  # parsed and validated against the schema (an approximated one can fail: SchemaViolationError)
            if either is not None:
                calls, content, finish = either.outcome(content, reason, ids[len(ids) - generated_count(lps):])
            elif plan.mode == "tools" and plan.tool_choice != "auto":
                calls, content, finish = self._calls(c, content, reason)
            elif trigger is not None and reason == "stop" and content.endswith(trigger):
                used = generated_count(lps)
                left = None if sampling.max_tokens is None else max(sampling.max_tokens - used, 0)
                cg, _ = self.call_generator(tool_call_schema(plan.tools, None), sampling, False, left)
                c = self._run(c, cg, left, [], rng, None, cancelled)
                state, last, reason = _reply_of(c)
                head = content[: -len(trigger)]
                calls, _, finish = self._calls(c, last["content"].removeprefix(content), reason)
                content = head  # the marker and the call's JSON are never content, even when cut
                ids, lps = row_tokens(state, 0)
            gen_n = generated_count(lps)
            toks, tlps = ids[len(ids) - gen_n:], lps[len(lps) - gen_n:]
            top = self._top(rec, r, first.rows, gen_n) if rec is not None else None
            rows.append(RowReply(content, calls, finish, toks, tlps, top, c, *thought))
        return Reply(rows, prompt_tokens, cached, prediction_tokens(first.state))

    def _run(self, chat: Chat, gen, max_tokens, stops, rng, on_delta, cancelled, on_reasoning=None) -> Chat:
        if on_delta is None:
            if cancelled():
                raise Cancelled()
            return chat.reply(gen, max_tokens=max_tokens, stop_at=stops or None, rng=rng)
        stream = chat.stream_reply(gen, max_tokens=max_tokens, stop_at=stops or None, rng=rng)
        texts: list[str] = []
        sent: list[int] = []
        guide = stream.reasoning  # with reasoning: each row's thought, then its answer (serve.reasoning)
        split: dict[int, Splitter] = {}
        for chunk in stream:
            if cancelled():
                del stream  # the decoding loop is left here: its generator is closed and its rows freed
                raise Cancelled()
            phases = stream.phases()  # (as of this chunk: the engine may be steps ahead)
            for r, text in enumerate([chunk] if isinstance(chunk, str) else chunk):
                while len(texts) <= r:
                    texts.append("")
                    sent.append(0)
                if guide is not None:
                    thought, texts[r] = split.setdefault(r, Splitter(guide, self.model.tokenizer)).feed(
                        text, phases[r] if r < len(phases) else None)
                    if thought and on_reasoning is not None:
                        on_reasoning(r, thought)
                    text = ""
                texts[r] += text
                safe = safe_length(texts[r], stops)  # a stop sequence is never streamed, nor its start
                if safe > sent[r]:
                    on_delta(r, texts[r][sent[r]:safe])
                    sent[r] = safe
        return stream.chat

    def _calls(self, c: Chat, text: str, reason) -> tuple[list[dict], str, str]:
        """The tool call a constrained reply wrote, or (no call, empty content, "length") when ``max_tokens``
        cut it: the envelope ``{"name": ..., "arguments": ...`` is internal and never returned as content,
        and a call whose arguments would not parse is not returned either (docs/serve.md)."""
        reason = reason if isinstance(reason, str) else reason[0]
        if reason not in ("pattern", "eos", "stop", "thinking_budget"):  # (a thought cut by its budget, then the call)
            return [], "", _finish(reason)
        value = c.value  # parsed and validated against the schema by the library
        value = value[0] if isinstance(value, list) else value
        call = {"id": new_id("call"), "name": value["name"], "arguments": _json.dumps(value["arguments"])}
        return [call], "", "tool_calls"

    def _usage(self, prev: SequenceState | None, state: SequenceState) -> tuple[int, int]:
        """(prompt tokens, of which reused from the previous state's cache), read from row 0."""
        ids, lps = row_tokens(state, 0)
        prompt = ids[: len(ids) - generated_count(lps)]
        if prev is None:
            return len(prompt), 0
        pids, _ = row_tokens(prev, 0)
        return len(prompt), min(common_prefix(pids, prompt), int(prev.cached_tokens.reshape(-1)[0]))

    def _top(self, rec: _Recording, r: int, rows: int, n: int) -> list[list[tuple[int, float]]]:
        out = []
        for values, ids in rec.steps[:n]:
            i = r if len(values) == rows else r * len(values) // rows
            out.append([(t, v) for t, v in zip(ids[i], values[i]) if v > -math.inf])
        return out

    def token_text(self, token: int) -> str:
        """One token's text for log-probs: its bytes with UTF-8 replacement, a SentencePiece leading space kept
        (the texts of a row's tokens join to its text); a special token's own text (``<|im_end|>``)."""
        data = self.model.tokenizer.piece_bytes(token)
        return data.decode("utf-8", "replace") if data else self.model.tokenizer.decode([token], skip_special=False)

    def token_bytes(self, token: int) -> list[int]:
        """One token's bytes (OpenAI's ``bytes``: a byte-fallback token's own byte, not its U+FFFD's)."""
        return list(self.model.tokenizer.piece_bytes(token) or self.token_text(token).encode())
