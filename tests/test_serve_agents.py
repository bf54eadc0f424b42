"""Agent shapes through ``continuum serve`` (issue 35), with the ``openai`` client and, where installed, the
agent libraries themselves (the ``agents`` test extra: pydantic-ai, the OpenAI Agents SDK; ``instructor``
apart: see pyproject.toml). What a tiny random model can show, checked against independent references
(``jsonschema``, pydantic's own validation, the clients' parsers):

* a tool whose parameters use ``$defs``/``$ref`` (nested pydantic models, recursion) is accepted and its
  calls validate;
* tools in ``tool_choice: "auto"`` plus a JSON response format: every reply is a valid call or a
  schema-valid answer, never free text (chat completions and Responses, streaming or not);
* a Responses chain of JSON replies reuses the whole previous turn at every turn (``cached_tokens``).
"""

from __future__ import annotations

import json
from typing import Literal

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from pydantic import BaseModel, Field

from serve_support import Adopt

MODEL = "tiny"


class Node(BaseModel):
    """A recursive model (#/$defs/Node refers to itself)."""

    v: Literal["a", "b"]
    kids: list[Node] = Field(default_factory=list, max_length=1)


class Card(BaseModel):
    mood: Literal["happy", "sad"]
    ok: bool


CLOCK = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
         "additionalProperties": False}


def card_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "card", "schema": Card.model_json_schema(), "strict": True}}


# ---------------------------------------------------------------- 1. references in tool parameters
def test_embedded_schema_keeps_its_references():
    """Unit: jsonschema (an independent resolver) judges a value under the parameters alone exactly as it judges
    the call under the envelope, for nested, recursive and root (``#``) references, one tool or several."""
    from continuum.serve.messages import tool_call_schema

    root_recursive = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                      "required": ["next"], "additionalProperties": False}
    params = {"adopt": Adopt.model_json_schema(), "tree": Node.model_json_schema(), "chain": root_recursive}
    values = {"adopt": [{"pet": {"kind": "cat", "age": 3}, "indoor": True}, {"pet": {"kind": "cow", "age": 3}, "indoor": True}],
              "tree": [{"v": "a", "kids": [{"v": "b", "kids": []}]}, {"v": "a", "kids": [{"v": "c"}]}],
              "chain": [{"next": {"next": None}}, {"next": {"next": 3}}]}
    tools = [{"name": n, "parameters": p} for n, p in params.items()]
    for only in [None, *params]:
        envelope = tool_call_schema(tools, only)
        for name in params if only is None else [only]:
            for value in values[name]:
                alone = jsonschema.Draft202012Validator(params[name]).is_valid(value)
                inside = jsonschema.Draft202012Validator(envelope).is_valid({"name": name, "arguments": value})
                assert alone == inside, (only, name, value)
    assert not jsonschema.Draft202012Validator(params["adopt"]).is_valid(values["adopt"][1])  # the pair can disagree


def test_nested_model_tool_call_validates(client):
    tool = openai.pydantic_function_tool(Adopt)  # strict, $defs/$ref, as the SDK writes it
    assert "$defs" in tool["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "Adopt"}}):
        r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Adopt a pet"}], tools=[tool],
                                          tool_choice=choice, max_tokens=60, temperature=0)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and isinstance(call.function.parsed_arguments, Adopt)
    tree = openai.pydantic_function_tool(Node)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A tree"}], tools=[tool, tree],
                                       tool_choice="required", max_tokens=80, temperature=0)
    if r.choices[0].finish_reason == "tool_calls":  # (a recursive value may run past max_tokens: then no call)
        call = r.choices[0].message.tool_calls[0]
        {"Adopt": Adopt, "Node": Node}[call.function.name].model_validate_json(call.function.arguments)
    resp = client.responses.create(model=MODEL, input="Adopt a pet", tools=[{"type": "function", **tool["function"]}],
                                   tool_choice="required", max_output_tokens=60, temperature=0, store=False)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert resp.status == "completed" and len(calls) == 1
    Adopt.model_validate_json(calls[0].arguments)


# ---------------------------------------------------------------- 2. a tool plus an output type
def _check_chat_reply(message, finish) -> str:
    """'call' or 'answer': a valid call, or content valid under the format; never free text."""
    if message.tool_calls:
        assert finish == "tool_calls" and not message.content
        jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), CLOCK)
        return "call"
    assert finish == "stop", finish
    Card.model_validate_json(message.content)
    return "answer"


def test_tools_in_auto_follow_the_response_format(client):
    tools = [{"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": CLOCK}}]
    seen = set()
    for seed in range(6):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": f"Card {seed}?"}], tools=tools, tool_choice="auto",
                  response_format=card_format(), max_tokens=60, temperature=1.0, seed=seed)
        r = client.chat.completions.create(**kw)
        seen.add(_check_chat_reply(r.choices[0].message, r.choices[0].finish_reason))
        chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        assert content == (r.choices[0].message.content or "") and len(calls) == len(r.choices[0].message.tool_calls or [])
    print("branches seen:", seen)


def test_responses_tools_in_auto_follow_text_format(client):
    tools = [{"type": "function", "name": "get_time", "description": "The time", "parameters": CLOCK}]
    fmt = {"format": {"type": "json_schema", "name": "card", "schema": Card.model_json_schema(), "strict": True}}
    for seed in range(4):
        kw = dict(model=MODEL, input=f"Card {seed}?", tools=tools, tool_choice="auto", text=fmt, max_output_tokens=60,
                  temperature=1.0, extra_body={"seed": seed}, store=False)
        resp = client.responses.create(**kw)
        assert resp.status == "completed"
        calls = [o for o in resp.output if o.type == "function_call"]
        if calls:
            jsonschema.validate(json.loads(calls[0].arguments), CLOCK)
        else:
            Card.model_validate_json(resp.output_text)
        with client.responses.stream(**kw) as stream:
            list(stream)
            final = stream.get_final_response()
        assert final.output_text == resp.output_text and len([o for o in final.output if o.type == "function_call"]) == len(calls)


def test_either_reaches_both_branches_in_process(lib):
    """In-process: the one grammar allows both branches (a seed for each is found), and the model's text
    decides: a call's JSON validates against the tool, an answer against the format."""
    from continuum.serve.served import Plan, Sampling, ServedModel

    engine = ServedModel(lib)
    tools = [{"name": "get_time", "description": "The time", "parameters": CLOCK}]
    plan = Plan("tools", schema=Card.model_json_schema(), strict=True, tools=tools, tool_choice="auto")
    chat_ = engine.chat([{"role": "user", "content": "A card or the time"}], tools)
    seen: dict[str, int] = {}
    for seed in range(40):
        row = engine.reply(chat_, plan, Sampling(temperature=2.0, seed=seed, max_tokens=60)).rows[0]
        kind = "call" if row.tool_calls else "answer"
        if kind == "call":
            assert row.finish_reason == "tool_calls" and row.content == ""
            jsonschema.validate(json.loads(row.tool_calls[0]["arguments"]), CLOCK)
        elif row.finish_reason == "stop":
            Card.model_validate_json(row.content)
        seen[kind] = seen.get(kind, 0) + 1
        if len(seen) == 2:
            break
    assert set(seen) == {"call", "answer"}, seen


# ---------------------------------------------------------------- 3. the model's own tokens kept across turns
def test_responses_json_chain_reuses_the_whole_previous_turn(client):
    fmt = {"format": {"type": "json_schema", "name": "card", "schema": Card.model_json_schema(), "strict": True}}
    prev, usage = None, []
    for turn in ["A card", "Another card", "One more", "The last card"]:
        r = client.responses.create(model=MODEL, input=turn, previous_response_id=prev, text=fmt, max_output_tokens=40,
                                    temperature=0)
        Card.model_validate_json(r.output_text)
        usage.append(r.usage)
        prev = r.id
    print("cached per turn:", [(u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens) for u in usage])
    for before, now in zip(usage, usage[1:]):  # all of the previous turn but its last token (never cached: its logits)
        assert now.input_tokens_details.cached_tokens >= before.input_tokens + before.output_tokens - 1
