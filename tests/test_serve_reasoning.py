"""The server with a reasoning model (issue 30), through the official ``openai`` client.

A tiny random Llama over a tokenizer with ``<think>``/``</think>`` special tokens and the Qwen3
template, served with ``--reasoning``. References: the library's own ``Chat`` reply (the same
rendering, greedy), jsonschema for structured answers, and the non-streamed reply for the stream.
"""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from continuum import generate, models, samplers
from continuum.chat import Chat

from conftest import FIXTURES, _sharpen, think_tokenizer, tiny_llama
from serve_support import Server

pytest.importorskip("openai")

QWEN3 = FIXTURES / "chat_templates" / "qwen3.jinja"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}}, "required": ["ok", "n"],
          "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_time", "description": "time in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": False}}}
pytestmark = pytest.mark.skipif(not QWEN3.exists(), reason="the Qwen3 template fixture is absent")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("think-model")
    tok = think_tokenizer()
    tok.chat_template = QWEN3.read_text()
    hf = _sharpen(tiny_llama(len(tok), bos=0, eos=2, max_positions=2048))
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("serve-think") / "store", "--reasoning")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def lib(model_dir):
    return models.transformers(model_dir)


def ask(client, stream=False, **kw):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "What time is it?"}], "temperature": 0,
            "max_tokens": 64, "extra_body": {"thinking_budget": 8}}
    extra = {**base.pop("extra_body"), **kw.pop("extra_body", {})}
    return client.chat.completions.create(**{**base, **kw}, extra_body=extra, stream=stream)


def streamed(chunks, index: int = 0) -> tuple[str, str, list]:
    thought, content, calls = "", "", []
    for ch in chunks:
        for c in ch.choices:
            if c.index != index:
                continue
            d = c.delta
            thought += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            calls += d.tool_calls or []
    return thought, content, calls


def test_reasoning_content_equals_the_library_and_streams_the_same_bytes(client, lib):
    r = ask(client)
    msg = r.choices[0].message
    thought = msg.model_extra["reasoning_content"]
    ref = Chat(lib, template=QWEN3.read_text(), reasoning=True).user("What time is it?").reply(
        generate.text(lib, samplers.greedy()), max_tokens=64, thinking_budget=8)
    assert thought == ref.messages[-1]["reasoning_content"] and msg.content == ref.value
    assert "think>" not in thought + msg.content
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    assert r.usage.completion_tokens_details.reasoning_tokens <= r.usage.completion_tokens
    s_thought, s_content, _ = streamed(ask(client, stream=True))
    assert (s_thought, s_content) == (thought, msg.content)


def test_a_slow_stream_reader_gets_the_reply_split_where_the_engine_split_it(lib):
    """Contract: a streamed reply is the non-streamed reply, however slowly its reader reads. The engine's thread
    decodes on while the stream's consumer handles a chunk, so each chunk carries the rows' phases read with its
    text in the loop's thread (``Step.phases``). Read from the guide when the consumer got to the chunk, the phase
    was steps ahead: the answer's first text went into the thought, or the newlines after the end marker into the
    content (seen one run in two through the server, every time with a reader this slow)."""
    from continuum.serve.served import Plan, Sampling, ServedModel

    engine = ServedModel(lib, QWEN3.read_text(), reasoning=True)
    plan, sampling = Plan(reasoning=True, thinking_budget=8), Sampling(temperature=0, max_tokens=48)
    chat = engine.chat([{"role": "user", "content": "What time is it?"}], reasoning=True)
    ref = engine.reply(chat, plan, sampling).rows[0]
    thought: list[str] = []
    content: list[str] = []

    def slow(into):
        return lambda row, text: (time.sleep(0.05), into.append(text))

    engine.reply(chat, plan, sampling, on_delta=slow(content), on_reasoning=slow(thought))
    assert ref.reasoning and ref.content
    assert ("".join(thought), "".join(content)) == (ref.reasoning, ref.content)


def test_strict_json_schema_applies_after_the_thought(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}
    r = ask(client, response_format=fmt, max_tokens=80)
    msg = r.choices[0].message
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    assert msg.model_extra["reasoning_content"] is not None and "think>" not in msg.content
    s_thought, s_content, _ = streamed(ask(client, stream=True, response_format=fmt, max_tokens=80))
    assert (s_thought, s_content) == (msg.model_extra["reasoning_content"], msg.content)


def test_a_required_tool_call_comes_after_the_thought(client):
    r = ask(client, tools=[TOOL], tool_choice="required", max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    assert isinstance(choice.message.model_extra["reasoning_content"], str)


def test_tools_in_auto_with_a_format_come_after_the_thought(client):
    """Issue 35: tools in "auto" plus a JSON format: the thought, then a valid call or a schema-valid answer."""
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        kw = dict(tools=[TOOL], tool_choice="auto", response_format=fmt, max_tokens=80, temperature=1.0, seed=seed)
        choice = ask(client, **kw).choices[0]
        msg = choice.message
        assert isinstance(msg.model_extra["reasoning_content"], str)
        if msg.tool_calls:
            assert choice.finish_reason == "tool_calls" and not msg.content
            jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), TOOL["function"]["parameters"])
        else:
            assert choice.finish_reason == "stop" and "think>" not in msg.content
            jsonschema.validate(json.loads(msg.content), SCHEMA)
        s_thought, s_content, s_calls = streamed(ask(client, stream=True, **kw))
        assert (s_thought, s_content or None, len(s_calls)) == (msg.model_extra["reasoning_content"], msg.content or None,
                                                                len(msg.tool_calls or []))


@pytest.mark.parametrize("extra", [{"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}])
def test_thinking_off_by_request(client, extra):
    r = ask(client, extra_body=extra)
    msg = r.choices[0].message
    assert not (msg.model_extra or {}).get("reasoning_content")
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_responses_reasoning_item_comes_before_the_message(client):
    kw = {"model": "tiny", "input": "Hello?", "temperature": 0, "max_output_tokens": 64, "reasoning": {"effort": "minimal"}}
    r = client.responses.create(**kw)
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.reasoning.effort == "minimal" and r.output[0].summary[0].text == ""  # minimal: a budget of 0
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert [o.type for o in final.output] == kinds
    assert final.output[1].content[0].text == r.output[1].content[0].text
    r2 = client.responses.create(**{**kw, "reasoning": {"effort": "low"}, "previous_response_id": r.id, "input": "Again?"})
    assert [o.type for o in r2.output] == ["reasoning", "message"]
    assert r2.usage.output_tokens_details.reasoning_tokens > 0


def test_reasoning_on_a_tokenizer_without_markers_fails_at_start(bpe_tokenizer):
    from continuum.errors import ReasoningError
    from continuum.serve.served import ServedModel

    model = models.Transformers(tiny_llama(len(bpe_tokenizer), bos=0, eos=0), bpe_tokenizer)
    with pytest.raises(ReasoningError, match="no '<think>'/'</think>' tokens"):
        ServedModel(model, reasoning=True)
    ServedModel(model)  # (off: nothing is checked)


def test_a_text_end_marker_split_across_chunks_never_leaks(bpe_tokenizer):
    from continuum.generate.reasoning import resolve_markers
    from continuum.guides.reasoning import ANSWER, THINK, ReasoningGuide
    from continuum.serve.reasoning import Splitter

    model = models.Transformers(tiny_llama(len(bpe_tokenizer), bos=0, eos=0), bpe_tokenizer)
    markers = resolve_markers(model.tokenizer, ("[T]", "[/T]"))
    split = Splitter(ReasoningGuide(None, markers, 8, initial=(THINK, 0)), model.tokenizer)
    steps = [("\nab", THINK), ("c\n[", THINK), ("/", THINK), ("T]\n\nan", ANSWER), ("s", ANSWER)]
    thought, answer = "", ""
    for chunk, phase in steps:
        delta, answer = split.feed(chunk, phase)
        thought += delta
        assert "[" not in thought and "[" not in answer
    assert (thought, answer) == ("abc", "ans")


def test_sampled_choices_stream_the_same_reasoning_and_content(client):
    kw = {"temperature": 1.0, "seed": 11, "n": 2, "max_tokens": 48}
    r = ask(client, **kw)
    chunks = list(ask(client, stream=True, **kw))
    for i, choice in enumerate(r.choices):
        thought, content, _ = streamed(chunks, i)
        assert (thought, content) == (choice.message.model_extra["reasoning_content"], choice.message.content)


def test_stop_sequences_cut_the_answer_not_the_thought(client):
    kw = {"stop": ["e", "a"], "max_tokens": 48}
    r = ask(client, **kw)
    free = ask(client, max_tokens=48)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == free.choices[0].message.model_extra["reasoning_content"]
    assert "e" not in msg.content and "a" not in msg.content and free.choices[0].message.content.startswith(msg.content)
    s_thought, s_content, _ = streamed(ask(client, stream=True, **kw))
    assert (s_thought, s_content) == (msg.model_extra["reasoning_content"], msg.content)
