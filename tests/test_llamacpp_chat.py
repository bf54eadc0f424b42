"""Chats on llama.cpp (``continuum.chat.Chat`` on a GGUF model), against independent references:

* rendering: the GGUF tokenizer's ``apply_chat_template`` gives the text and ids transformers gives for the same
  vocabulary (stories260K as safetensors and as GGUF), on every fixture template, tools included;
* replies: a chat on the GGUF equals the same chat on the transformers backend (same weights), follows
  llama-cpp-python's own evaluation of its ids, and computes only each turn's new tokens;
* the real model (Gemma 3 270M Q4_K_M, skipped when the registry package is absent): a chat on the Gemma 3
  template, a JSON reply (jsonschema), then a slice and a continuation past the 512-position sliding window,
  every reply token llama.cpp's own argmax where the reference's margin is clear.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from continuum import continuous, generate, models, samplers
from continuum.chat import Chat
from continuum.errors import ChatTemplateError

from conftest import FIXTURES
from llamacpp_support import assert_agree_up_to_a_tie, check_greedy_path, fp32_model, gemma_path, gguf

TEMPLATES = sorted((FIXTURES / "chat_templates").glob("*.jinja"))
MESSAGES = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How are you?"},
            {"role": "user", "content": "Tell me a story."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def model():
    return models.llamacpp(gguf("f32"), n_threads=2)


def _ids(state) -> list[int]:
    return state.token_ids[0][state.attention_masks[0].bool()].tolist()


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_templates_render_as_transformers_renders_them(model, stories, path):
    template = path.read_text()
    for extra in ({}, {"tools": TOOLS}):
        ours = model.tokenizer.apply_chat_template(MESSAGES, chat_template=template, add_generation_prompt=True,
                                                   tokenize=False, **extra)
        ref = stories.tokenizer.apply_chat_template(MESSAGES, chat_template=template, add_generation_prompt=True,
                                                    tokenize=False, **extra)
        assert ours == ref
        assert model.tokenizer.apply_chat_template(MESSAGES, chat_template=template, add_generation_prompt=True,
                                                   tokenize=True, **extra) == stories.tokenizer.hf(
            ref, add_special_tokens=False)["input_ids"]


def test_a_chat_equals_the_same_chat_on_transformers_and_follows_llama_cpp(stories):
    """On llama.cpp with an f32 KV cache and no flash attention, each turn's ids equal transformers' up to the first
    near-tie within ``CROSS_TOL`` (``llamacpp_support``; a later turn is compared only after an equal one), every
    reply token llama.cpp's own argmax where the reference's margin is clear, and a turn computes only its own
    tokens."""
    model = fp32_model()
    template = (FIXTURES / "chat_templates" / "smollm2.jinja").read_text()
    chats = {}
    for m in (model, stories):
        c = Chat(m, system="You tell stories.", template=template).user("Tell me about a cat.")
        c = c.reply(generate.text(m, samplers.greedy()), max_tokens=24)
        before = m.tokens_computed
        c2 = c.user("And a dog?").reply(generate.text(m, samplers.greedy()), max_tokens=16)
        chats[m] = (c, c2, m.tokens_computed - before)
    (c, c2, computed), (ref, ref2, _) = chats[model], chats[stories]
    assert_agree_up_to_a_tie(_ids(c.state), _ids(ref.state), stories)
    if _ids(c.state) == _ids(ref.state):
        assert c.value == ref.value
        assert_agree_up_to_a_tie(_ids(c2.state), _ids(ref2.state), stories)
        if _ids(c2.state) == _ids(ref2.state):
            assert c2.value == ref2.value
    assert computed <= len(_ids(c2.state)) - len(_ids(c.state)) + 1  # the new turn only, never the history
    check_greedy_path(_ids(c2.state), len(_ids(c2.state)) - 16)


def test_json_and_choice_replies_on_llama_cpp(model):
    template = (FIXTURES / "chat_templates" / "smollm2.jinja").read_text()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "happy": {"type": "boolean"}},
              "required": ["name", "happy"], "additionalProperties": False}
    c = Chat(model, template=template).user("Describe the cat as JSON.")
    c = c.reply(generate.json(model, schema, samplers.greedy()), max_tokens=60)
    jsonschema.validate(c.value, schema)
    assert json.loads(c.messages[-1]["content"]) == c.value
    c = c.user("Was the cat happy?").reply(generate.choice(model, ["yes", "no"], samplers.greedy(), method="greedy"))
    assert c.value in ("yes", "no") and c.messages[-1]["content"] == c.value


def test_a_gguf_without_a_template_is_refused_clearly(model):
    if model.tokenizer.chat_template is None:
        with pytest.raises(ChatTemplateError, match="template="):
            Chat(model)
    with pytest.raises(ChatTemplateError, match="refused"):  # the template's own raise_exception, worded by continuum
        Chat(model, template="{{ raise_exception('no system turn') }}").user("Hi")


def test_gemma3_chat_json_and_a_continuation_past_the_sliding_window():
    """The real model end to end: the Gemma 3 template renders control tokens as tokens, a JSON reply is valid,
    and a state sliced and continued beyond the 512-position window follows llama.cpp's own evaluation."""
    model = models.llamacpp(gemma_path(), n_threads=2)
    tok = model.tokenizer
    template = (FIXTURES / "chat_templates" / "gemma3.jinja").read_text()
    start, end = tok.added_token_id("<start_of_turn>"), tok.added_token_id("<end_of_turn>")
    assert start is not None and end in tok.eos_token_ids
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    c = Chat(model, template=template).user("Paris is the capital of France. Give the city and its country as JSON.")
    c = c.reply(generate.json(model, schema, samplers.greedy()), max_tokens=30)
    jsonschema.validate(c.value, schema)
    assert json.loads(c.messages[-1]["content"]) == c.value
    assert _ids(c.state).count(start) == 2  # one <start_of_turn> per turn: parsed as tokens, not spelled out

    story = " ".join(f"Day {i}: the baker of Lyon sold bread, the river rose, and the bells rang at noon." for i in range(30))
    c = c.user(story + "\nWhat did the baker sell?").reply(generate.text(model, samplers.greedy()), max_tokens=12)
    ids = _ids(c.state)
    assert len(ids) > 600  # the window (512) is behind the reply
    check_greedy_path(ids, len(ids) - 12, kind="gemma")

    text = str(c.state)
    cut = c.state[:text.index("Day 25:")]  # back behind the reply, past the window's first 512 positions
    before = model.tokens_computed
    resumed = generate.text(model, samplers.greedy())
    s = continuous(resumed)(cut + "Day 25: the baker", max_tokens=10)
    assert model.tokens_computed - before <= len(_ids(s)) - len(_ids(cut)) + 1  # the cut state's cells were reused
    check_greedy_path(_ids(s), len(_ids(s)) - 10, kind="gemma")
