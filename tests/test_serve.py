"""``continuum serve`` driven by the official ``openai`` client against a real server process.

One server per module (starting one is the slow part). References are independent: the library
called in-process on the same model folder (``Chat`` + greedy ``generate.text``), ``jsonschema`` for
structured outputs and tool arguments, and the same request made without streaming.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_support import KEYS, ROOT

MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": CLOCK}}]
CARD = {"type": "object", "properties": {"mood": {"type": "string", "enum": ["happy", "sad"]}, "ok": {"type": "boolean"},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["mood", "ok", "n"], "additionalProperties": False}


# model_dir, server, client, lib: the shared module-scoped fixtures of tests/serve_fixtures.py (via conftest)


def lib_turns(lib, turns, max_tokens, history=None):
    """The in-process reference: each user turn replied to greedily on one continuous chat."""
    from continuum import generate, samplers
    from continuum.chat import Chat

    gen = generate.text(lib, samplers.greedy())
    c, out = Chat(lib), []
    for m in history or []:
        c = c.message(m["role"], m["content"])
    for u in turns:
        c = c.user(u).reply(gen, max_tokens=max_tokens)
        out.append(c.messages[-1]["content"])
    return out


def chat(client, content, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


# ---------------------------------------------------------------- basics
def test_library_does_not_import_the_server_deps():
    import subprocess
    import sys

    code = "import sys, continuum; bad = [m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=120,
                         check=False)
    assert out.stdout.strip() == "[]", out.stderr


def test_cli_arguments():
    from continuum.__main__ import main
    from continuum.serve.cli import parse_age, parser

    assert main(["nope"]) == 2
    args = parser().parse_args(["m", "--api-key", "a", "--api-key", "b", "--retention-age", "12h", "--state-memory", "64MiB"])
    assert args.api_keys == ["a", "b"] and args.retention_age == 12 * 3600 and args.state_memory == 64 << 20
    assert args.host == "127.0.0.1" and args.port == 8000 and parse_age("none") is None
    assert args.retention_interval == 60.0  # retention's own schedule (serve/retention.py)
    assert parser().parse_args(["m", "--retention-interval", "5m"]).retention_interval == 300.0
    assert parser().parse_args(["m", "--retention-interval", "none"]).retention_interval is None


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert server.health()["status"] == "ok"
    assert server.ready().json() == {"status": "ready"}  # a folder store: ready once open
    before = server.health()["engine"]
    chat(client, "Hello there", max_tokens=4)
    after = server.health()["engine"]  # the engine's counters: a reply ran steps, their forwards inside them
    assert after["steps"] > before["steps"] and 0 < after["forward_s"] <= after["busy_s"]
    assert 0.0 <= after["outside_forward_share"] < 1.0


def test_chat_completion_equals_library_and_stream(client, lib):
    ref = lib_turns(lib, ["Hello there"], 10)[0]
    r = chat(client, "Hello there", max_tokens=10)
    assert r.choices[0].message.content == ref and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 10 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(chat(client, "Hello there", max_tokens=10, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    two = chat(client, "Hello there", max_tokens=10, n=2)  # greedy: every choice is the same reply
    assert [c.message.content for c in two.choices] == [ref, ref]


def test_chat_roles_parts_and_developer(client, lib):
    history = [{"role": "system", "content": "Be brief."}]
    ref = lib_turns(lib, ["Hi"], 6, history)[0]
    r = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert r.choices[0].message.content == ref


def test_chat_logprobs_and_stop(client):
    r = chat(client, "Hello there", max_tokens=8, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    full = r.choices[0].message.content
    stop = next((full[i:i + 2] for i in range(2, len(full) - 2) if full[i:i + 2].strip() and full.find(full[i:i + 2]) == i), None)
    if stop is None:
        pytest.skip("no usable stop string in this reply")
    cut = chat(client, "Hello there", max_tokens=8, stop=[stop])
    assert cut.choices[0].message.content == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, "Hello there", max_tokens=8, stop=stop, stream=True)
                       if c.choices)
    assert streamed == cut.choices[0].message.content


# ---------------------------------------------------------------- structured outputs and tools
def test_json_schema_strict_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "card", "schema": CARD, "strict": True}}
    r = chat(client, "A card as JSON", max_tokens=60, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CARD)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, "A card as JSON", max_tokens=60,
                                                                       response_format=fmt, stream=True) if c.choices)
    assert streamed == r.choices[0].message.content


def test_json_object(client):
    r = chat(client, "Any JSON object", max_tokens=40, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_calls_parse_validate_and_continue(client, tool_choice):
    r = chat(client, "Weather in Rome?", max_tokens=80, tools=TOOLS, tool_choice=tool_choice)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    schemas = {"get_weather": WEATHER, "get_time": CLOCK}
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert call.id.startswith("call_") and len(call.id) >= 32
    # the tool's result goes back, and the model answers it
    follow = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, tools=TOOLS, tool_choice="none", messages=[
        {"role": "user", "content": "Weather in Rome?"}, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 25C"}])
    assert follow.choices[0].finish_reason in ("stop", "length") and not follow.choices[0].message.tool_calls


@pytest.mark.parametrize("max_tokens", [1, 4, 9])
def test_tool_call_cut_by_max_tokens_never_leaks_the_envelope(client, max_tokens):
    """Issue 31: a call cut by ``max_tokens`` is no call and empty content with ``finish_reason: length``
    (chat completions, streaming or not) and an incomplete response with no function_call (Responses,
    streaming or not); the internal ``{"name": ...`` envelope is never text."""
    r = chat(client, "Weather in Rome?", max_tokens=max_tokens, tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls and not choice.message.content
    assert r.usage.completion_tokens == max_tokens  # it was generated, then withheld
    chunks = [c for c in chat(client, "Weather in Rome?", max_tokens=max_tokens, tools=TOOLS, tool_choice="required",
                              stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert not any(c.choices[0].delta.tool_calls for c in chunks) and chunks[-1].choices[0].finish_reason == "length"
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    resp = client.responses.create(model=MODEL, input="Weather in Rome?", tools=tools, tool_choice="required",
                                   max_output_tokens=max_tokens, temperature=0, store=False)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "" and not [o for o in resp.output if o.type == "function_call"]
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=tools, tool_choice="required",
                                 max_output_tokens=max_tokens, temperature=0, store=False) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.status == "incomplete" and final.output_text == ""
    assert not [e for e in events if e.type.startswith("response.function_call") or e.type == "response.output_text.delta"]


def test_tool_call_that_fits_max_tokens_is_never_cut(client, lib):
    """Issue 31, the better behaviour: a ``max_tokens`` that fits the shortest valid call is never cut (the
    call is steered to close: ``serve/closing.py``); one token less than the automaton's shortest cannot
    fit and is cut as before. The budget is counted independently: the tokens of the shortest valid call's
    text. (Schemas outlines-core enforces exactly; ``get_time``'s enum is one.)"""
    from continuum.serve.closing import _distances
    from continuum.serve.messages import tool_call_schema
    from continuum.serve.served import Plan, Sampling, ServedModel

    tools = [dict(TOOLS[1]["function"])]
    shortest_text = '{"name":"get_time","arguments":{"tz":"UTC"}}'
    fits = len(lib.tokenizer.hf(shortest_text, add_special_tokens=False)["input_ids"])
    engine = ServedModel(lib)
    gen, _ = engine.call_generator(tool_call_schema(tools, None), Sampling(temperature=0), False, fits)
    _, dist = _distances(gen.guide.inner)
    least = dist[gen.guide.inner.initial_state]
    assert least <= fits
    chat_ = engine.chat([{"role": "user", "content": "What time is it?"}], tools)
    plan = Plan("tools", tools=tools, tool_choice="get_time")
    for budget in (least, fits, fits + 2):
        row = engine.reply(chat_, plan, Sampling(temperature=0, max_tokens=budget)).rows[0]
        assert row.finish_reason == "tool_calls" and len(row.tokens) <= budget, budget
        jsonschema.validate(json.loads(row.tool_calls[0]["arguments"]), CLOCK)
    cut = engine.reply(chat_, plan, Sampling(temperature=0, max_tokens=least - 1)).rows[0]
    assert cut.finish_reason == "length" and cut.tool_calls == [] and cut.content == ""
    # through the server, streaming or not, chat completions and Responses
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, "What time is it?", max_tokens=fits, tools=TOOLS[1:], tool_choice=choice)
    assert r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), CLOCK)
    chunks = [c for c in chat(client, "What time is it?", max_tokens=fits, tools=TOOLS[1:], tool_choice=choice, stream=True)
              if c.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    resp = client.responses.create(model=MODEL, input="What time is it?", tools=[{"type": "function", **TOOLS[1]["function"]}],
                                   tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=fits,
                                   temperature=0, store=False)
    assert resp.status == "completed" and [o.type for o in resp.output] == ["function_call"]


def test_tool_choice_auto_is_text_or_a_valid_call(client):
    r = chat(client, "Weather in Oslo?", max_tokens=60, tools=TOOLS)
    m = r.choices[0].message
    for call in m.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name])
    assert m.tool_calls or isinstance(m.content, str)


def test_tool_choice_auto_continues_into_a_call_at_the_marker(lib):
    """In-process (a random model never writes the template's marker): pretend the marker is text the
    model writes, so the text phase stops there and the same state continues with a constrained call."""
    from continuum.serve.served import Plan, Sampling, ServedModel

    engine = ServedModel(lib)
    tools = [dict(t["function"]) for t in TOOLS]
    chat_ = engine.chat([{"role": "user", "content": "Weather in Oslo?"}], tools)
    plan, sampling = Plan("tools", tools=tools, tool_choice="auto"), Sampling(temperature=0, max_tokens=120)
    free = engine.reply(chat_, plan, sampling).rows[0].content
    at = next((i for i in range(1, len(free) - 2) if free.find(free[i:i + 2]) == i and free[i:i + 2].strip()), None)
    if at is None:
        pytest.skip("no usable marker in this reply")
    engine._trigger = free[at:at + 2]
    row = engine.reply(chat_, plan, sampling).rows[0]
    assert row.finish_reason == "tool_calls" and row.content == free[:at] and len(row.tool_calls) == 1
    call = row.tool_calls[0]
    jsonschema.validate(json.loads(call["arguments"]), {"get_weather": WEATHER, "get_time": CLOCK}[call["name"]])
    # cut inside the call: the text before the marker only (no marker, no envelope), and no call
    cut = engine.reply(chat_, plan, Sampling(temperature=0, max_tokens=len(row.tokens) - 1)).rows[0]
    assert cut.finish_reason == "length" and cut.content == free[:at] and cut.tool_calls == []


def test_chat_with_state_continues_a_saved_state(lib, tmp_path):
    """``Chat.with_state`` (what the server continues stored responses with): a chat rebuilt from its
    messages on a saved-and-loaded state replies like the original chat, reusing the state's cache."""
    from continuum import SequenceState, generate, samplers
    from continuum.chat import Chat
    from continuum.errors import ContinuumTypeError

    gen = generate.text(lib, samplers.greedy())
    first = Chat(lib).user("Hello there").reply(gen, max_tokens=6)
    first.state.save(tmp_path / "s.safetensors")
    loaded = SequenceState.load(tmp_path / "s.safetensors", lib)
    rebuilt = Chat(lib)
    for m in first.messages:
        rebuilt = rebuilt.message(m["role"], m["content"])

    def computed(c):
        before = lib.tokens_computed
        out = c.user("More?").reply(gen, max_tokens=6)
        return out, lib.tokens_computed - before

    again, n_again = computed(rebuilt.with_state(loaded))
    direct, n_direct = computed(first)
    fresh, n_fresh = computed(rebuilt)
    assert again.messages == direct.messages and again.state.token_ids.tolist() == direct.state.token_ids.tolist()
    assert fresh.messages[:-1] == direct.messages[:-1]  # (its reply may differ: a stateless chat has the canonical tokens)
    assert n_again == n_direct < n_fresh  # the loaded cache was reused like the original state's
    with pytest.raises(ContinuumTypeError):
        rebuilt.with_state("not a state")


# ---------------------------------------------------------------- legacy completions
def test_completions(client, lib):
    from continuum import generate, samplers

    ref = generate.text(lib, samplers.greedy())("Once upon a time", max_tokens=8)
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2, echo=True)
    assert r.choices[0].text == "Once upon a time" + ref
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.total_tokens  # echo: the prompt too
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2)
    assert plain.choices[0].logprobs.token_logprobs == lp.token_logprobs[r.usage.prompt_tokens:]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True))
    assert streamed == ref


# ---------------------------------------------------------------- responses: stateful and exact
def test_responses_chain_equals_library_and_reuses_state(client, lib):
    turns = ["Hello there", "Tell me more", "And then?"]
    ref = lib_turns(lib, turns, 8)
    prev, outs = None, []
    for i, t in enumerate(turns):
        r = client.responses.create(model=MODEL, input=t, previous_response_id=prev, max_output_tokens=8, temperature=0)
        outs.append(r.output_text)
        cached = r.usage.input_tokens_details.cached_tokens
        assert (cached == 0) if i == 0 else (0 < cached < r.usage.input_tokens)
        prev = r.id
    assert outs == ref
    got = client.responses.retrieve(prev)
    assert got.id == prev and got.output_text == outs[-1] and got.previous_response_id is not None


def test_responses_branches_share_the_prefix(client, lib):
    root = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=6, temperature=0)
    a = client.responses.create(model=MODEL, input="Left?", previous_response_id=root.id, max_output_tokens=6, temperature=0)
    b = client.responses.create(model=MODEL, input="Right?", previous_response_id=root.id, max_output_tokens=6, temperature=0)
    assert a.output_text == lib_turns(lib, ["Hello there", "Left?"], 6)[1]
    assert b.output_text == lib_turns(lib, ["Hello there", "Right?"], 6)[1]
    assert a.usage.input_tokens_details.cached_tokens > 0 and b.usage.input_tokens_details.cached_tokens > 0


def test_responses_stream_equals_nonstream(client):
    ref = client.responses.create(model=MODEL, input="Stream me", instructions="Be brief.", max_output_tokens=8, temperature=0)
    with client.responses.stream(model=MODEL, input="Stream me", instructions="Be brief.", max_output_tokens=8,
                                 temperature=0) as stream:
        kinds, deltas = [], []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == ref.output_text == final.output_text
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.usage.output_tokens == ref.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == ref.output_text  # stored before completed was sent


def test_responses_store_false_and_delete(client):
    r = client.responses.create(model=MODEL, input="Forget me", max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    kept = client.responses.create(model=MODEL, input="Keep me", max_output_tokens=4, temperature=0)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="more", previous_response_id=kept.id, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)


def test_responses_json_schema_and_function_calls(client):
    r = client.responses.create(model=MODEL, input="A card", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "card", "schema": CARD, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), CARD)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}]
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, tool_choice="required",
                                max_output_tokens=80, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    done = client.responses.create(model=MODEL, previous_response_id=r.id, tools=tools, max_output_tokens=6, temperature=0,
                                   tool_choice="none", input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                               "output": "sunny"}])
    assert done.status in ("completed", "incomplete") and done.usage.input_tokens_details.cached_tokens > 0


# ---------------------------------------------------------------- bad input
BAD_CHAT = [
    ({"max_tokens": -1}, 400), ({"temperature": "hot"}, 400), ({"n": 0}, 400), ({"model": "nope"}, 404),
    ({"messages": []}, 400), ({"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ({"messages": [{"role": "user", "content": "x " * 3000}]}, 400),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400),
]


@pytest.mark.parametrize("change,status", BAD_CHAT)
def test_bad_chat_requests_get_error_bodies(server, change, status):
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **change}
    t0 = time.monotonic()
    r = httpx.post(server.url + "/chat/completions", json=body, timeout=30, headers=AUTH)
    assert r.status_code == status and time.monotonic() - t0 < 10
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_malformed_and_oversized_bodies(server):
    import httpx

    r = httpx.post(server.url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json", **AUTH})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/responses", content=b" " * (9 << 20), headers={"content-type": "application/json", **AUTH})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(server.url + "/responses/resp_unknown", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.post(server.url + "/responses", json={"model": MODEL, "input": "x", "max_output_tokens": "5"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    assert server.health()["status"] == "ok"  # still serving


# ---------------------------------------------------------------- concurrency
def test_concurrent_clients_equal_sequential(server, client, lib):
    prompts = [f"Client {i} says hi" for i in range(16)]

    def run(p):
        a = client.responses.create(model=MODEL, input=p, max_output_tokens=6, temperature=0)
        b = client.responses.create(model=MODEL, input="Go on", previous_response_id=a.id, max_output_tokens=6, temperature=0)
        return [a.output_text, b.output_text]

    results: dict = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, run(p))) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 16
    for p in prompts:  # each equals the same conversation run alone, in-process
        assert results[p] == lib_turns(lib, [p, "Go on"], 6)
