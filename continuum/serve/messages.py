"""OpenAI messages as chat templates read them, ids, and the schema a tool call is generated under."""

from __future__ import annotations

import json as _json
import secrets
from typing import Any

from ..guides.embed import embed, pointer
from .errors import APIError

__all__ = ["chat_messages", "new_id", "template_message", "text_of", "tool_call_schema"]


def new_id(prefix: str) -> str:
    """An unguessable id: 192 random bits."""
    return f"{prefix}_{secrets.token_hex(24)}"


def text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type not in ("text", "input_text", "output_text") or part.text is None:
            raise APIError(400, f"{where}: content part {i} has type {part.type!r}; this server reads text parts only "
                                f"(type 'text' with a 'text' field)", param=f"{where}.content[{i}]")
        texts.append(part.text)
    return "".join(texts)


def template_message(msg: dict) -> dict:
    """An OpenAI message as chat templates read it: ``developer`` is ``system``, tool-call arguments are dicts."""
    out = {"role": "system" if msg["role"] == "developer" else msg["role"], "content": msg.get("content") or ""}
    if msg.get("tool_calls"):
        calls = []
        for c in msg["tool_calls"]:
            args: Any = c["function"]["arguments"]
            try:
                args = _json.loads(args) if isinstance(args, str) else args
            except ValueError:
                pass  # a client's own malformed arguments: rendered as the text it sent
            calls.append({"id": c.get("id", ""), "type": "function",
                          "function": {"name": c["function"]["name"], "arguments": args}})
        out["tool_calls"] = calls
    for key in ("name", "tool_call_id"):
        if msg.get(key) is not None:
            out[key] = msg[key]
    return out


def chat_messages(messages) -> list[dict]:
    """Validated chat-completions messages as plain OpenAI dicts (text parts joined)."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": text_of(m.content, f"messages[{i}]")}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for c in m.tool_calls]
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def tool_call_schema(tools: list[dict], only: str | None, at: str = "") -> dict:
    """The schema of a call ``{"name": ..., "arguments": {...}}`` to one of ``tools`` (or to ``only``), to be
    placed at the JSON pointer ``at`` of the schema it is generated under (``""``: it is that schema).
    Each tool's parameters keep their own references (``$defs`` of nested models, recursion): they are
    rewritten to where the parameters lie in the envelope (:func:`continuum.guides.embed.embed`)."""
    chosen = [t for t in tools if only is None or t["name"] == only]

    def one(t: dict, here: str) -> dict:
        params = t.get("parameters") or {"type": "object", "properties": {}}
        return {"type": "object", "properties": {"name": {"const": t["name"]},
                                                 "arguments": embed(params, here + "/properties/arguments")},
                "required": ["name", "arguments"], "additionalProperties": False}

    if len(chosen) == 1:
        return one(chosen[0], at)
    return {"anyOf": [one(t, at + pointer("anyOf", i)) for i, t in enumerate(chosen)]}
