"""A reply that is a tool call OR an answer under the response format: one grammar over both.

With ``tools``, ``tool_choice: "auto"`` and a JSON ``response_format`` (chat completions) or
``text.format`` (Responses), OpenAI's contract is that a reply which is not a tool call follows the
format. The reply is generated under ONE llguidance grammar::

    start:  answer | call
    answer: %json {the response format's schema}
    call:   TRIGGER %json {the envelope {"name": ..., "arguments": ...} of any offered tool}

so the model's first tokens decide the branch and both branches are exact: the answer is JSON under
the format (whitespace bounded as in ``json_schema`` replies), the call the template's tool-call
marker (``<tool_call>`` for Qwen; a special token is matched as that token) followed by compact call
JSON under each tool's parameters. Each branch's schema is prepared exactly as ``generate.json``
prepares it (normalised, bounded, spelled for llguidance) and its output is validated the same way.

Example:
    >>> either = Either.build(model, tools, {"type": "object"}, False, "<tool_call>", sampler)  # doctest: +SKIP
    >>> either.split('<tool_call>{"name":"get_time","arguments":{"tz":"UTC"}}')  # doctest: +SKIP
    ('call', '{"name":"get_time","arguments":{"tz":"UTC"}}')
"""

from __future__ import annotations

import json as _json
import logging
from dataclasses import dataclass
from typing import Any

from .. import generate
from ..guides.compile import json_for
from ..guides.prepare import PreparedSchema
from .messages import new_id, tool_call_schema

__all__ = ["Either", "read_trigger"]

logger = logging.getLogger("continuum.serve")

_PROBE_NAME = "CONTINUUM_TOOL_PROBE"
_DEFAULT_TRIGGER = "<tool_call>"


def read_trigger(tok, template: str | None) -> str:
    """The text a template puts before a tool call's JSON (``<tool_call>`` for Qwen), read by rendering one
    (the default marker when the template cannot render a call)."""
    user = [{"role": "user", "content": "Hi"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}]}
    trigger = _DEFAULT_TRIGGER
    try:
        before = tok.apply_chat_template(user, chat_template=template, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(user + [call], chat_template=template, tokenize=False)
        if isinstance(full, str) and full.startswith(before) and _PROBE_NAME in full:
            seg = full[len(before):full.index(_PROBE_NAME)]
            cut = seg[:seg.rfind("{")].strip() if "{" in seg else ""
            trigger = cut.splitlines()[-1].strip() if cut else trigger  # the last line: not an empty <think> block before it
    except Exception as exc:  # noqa: BLE001 - a template that cannot render tool calls: the default marker
        logger.debug("the chat template cannot render a tool call (%s): tool-call marker %r", exc, trigger)
    return trigger


def _schema_of(guide) -> dict:
    """The JSON schema (with its ``x-guidance`` options) of an llguidance JSON guide's grammar."""
    grammars = _json.loads(guide.grammar)["grammars"]
    assert len(grammars) == 1 and grammars[0].get("json_schema") is not None, grammars
    return grammars[0]["json_schema"]


@dataclass
class Either:
    """The generator of a call-or-answer reply, and how its text is read back."""

    generator: Any
    trigger: str
    trigger_id: int | None  # the trigger as one special token (decoded texts leave it out), else None
    answer: PreparedSchema
    call: PreparedSchema

    @classmethod
    def build(cls, model, tools: list[dict], schema: dict, strict: bool, trigger: str, sampler, *,
              max_string_length: int | None = None, bounds: Any = "default", fast_forward: bool = True) -> Either:
        tok = model.tokenizer
        answer_guide, answer = json_for(tok, schema, whitespace_pattern=r"[ ]?", backend="llguidance",
                                        max_string_length=max_string_length, additional_properties=schema == {"type": "object"},
                                        on_unsupported="raise" if strict else "approximate", bounds=bounds)
        call_guide, call = json_for(tok, tool_call_schema(tools, None), whitespace_pattern="", backend="llguidance",
                                    max_string_length=max_string_length, on_unsupported="raise", bounds=bounds)
        ids = tok.encode_special(trigger)
        trigger_id = ids[0] if len(ids) == 1 and ids[0] in tok.special_ids else None
        marker = f"<[{trigger_id}]>" if trigger_id is not None else _json.dumps(trigger)
        lark = (f"start: answer | call\nanswer: %json {_json.dumps(_schema_of(answer_guide))}\n"
                f"call: {marker} %json {_json.dumps(_schema_of(call_guide))}\n")
        gen = generate.cfg(model, lark, sampler, fast_forward=fast_forward)
        return cls(gen, trigger, trigger_id, answer, call)

    def outcome(self, text: str, reason: str, tokens: list[int]) -> tuple[list[dict], str, str]:
        """(tool calls, content, finish reason) of a reply's text (``tokens``: its generated ids), each branch
        validated against its schema (``SchemaViolationError`` otherwise: no silent wrong result). A call cut by
        ``max_tokens`` is neither a call nor content (as with ``tool_choice: "required"``); a cut answer is
        the partial text, finish reason ``"length"`` (as with ``response_format`` alone)."""
        kind, body = self.split(text, self.trigger_id is not None and self.trigger_id in tokens)
        done = reason in ("pattern", "eos", "stop", "thinking_budget")
        if kind == "call":
            if not done:
                return [], "", "length"
            value = self.call.parse(body)
            return [{"id": new_id("call"), "name": value["name"], "arguments": _json.dumps(value["arguments"])}], "", "tool_calls"
        if done:
            self.answer.parse(body)
        return [], body, "stop" if done else "length"

    def split(self, text: str, special: bool = False) -> tuple[str, str]:
        """``("call", the call's JSON text)`` or ``("answer", text)``: the branch a reply (even a cut one) took;
        ``special``: the trigger's special token is among the reply's tokens (decoded texts leave it out)."""
        if text.startswith(self.trigger):
            return "call", text[len(self.trigger):]
        return ("call", text) if special else ("answer", text)
