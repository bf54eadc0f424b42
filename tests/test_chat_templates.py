"""Chat sessions (issue 15) on every fixture chat template, against a stateless reference loop: the turns.

The reference is what a serving loop without state does at every turn: render the messages with
``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` and run HF ``generate``. Every
reply must continue that prompt template-exactly (the same text; every token outside the model's
earlier replies the canonical one; the replies keep the model's own tokens), greedy replies must
equal HF's on that prompt token for token, turn after turn, and each turn must compute only the
tokens after the longest common prefix with the previous state (counted with a forward hook).

Here: that invariant on every template, templates that rewrite the history (Qwen3 drops earlier reasoning,
Llama-3 trims replies), the end-of-turn marker read from the template (a special token, or text cut as a stop
string), templates' refusals and bad inputs, tools and template kwargs. The kinds of replies (constrained, forks,
beams, streams, long chats, HTML): ``test_chat_replies.py``; the templates, the tiny models and the reference:
``chat_support.py``.
"""

from __future__ import annotations

import pytest
import torch

from continuum import ChatTemplateError, generate, samplers
from continuum.chat import Chat
from continuum.errors import ContinuumTypeError

from chat_support import (
    NO_SYSTEM_ROLE,
    TEMPLATES,
    canonical,
    chat_for,
    check_logprobs,
    greedy_turns,
    hf_greedy,
    row_ids,
    template,
    tiny,
)
from conftest import count_forward_tokens


# ------------------------------------------------------------------------------------ the invariant
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_every_reply_continues_the_canonical_prompt_and_equals_hf_generate(name):
    turns = ["Hello, who are you?", "Tell me a story about a cat.", "Shorter."]
    if name in NO_SYSTEM_ROLE:  # every other template takes one (gemma3 writes it into the first user turn)
        chat, _ = greedy_turns(name, turns)
    else:
        model, chat = chat_for(name, system="You are terse.")
        chat, _ = greedy_turns(name, turns, chat=chat, model=model)
    assert chat.messages[0]["role"] == ("user" if name in NO_SYSTEM_ROLE else "system")
    assert len(chat.messages) == 2 * len(turns) + (name not in NO_SYSTEM_ROLE)
    check_logprobs(chat.state)


def test_a_turn_computes_only_its_new_tokens_and_the_generated_ones():
    # SmolLM2's template is prefix-stable: after the first turn, a turn computes the new tokens
    # (closing the reply, the user message, the generation prompt) + the generated ones
    chat, computed = greedy_turns("smollm2", ["One.", "Two, a longer message this time.", "Three."], max_tokens=4)
    model = tiny(TEMPLATES["smollm2"])
    prompts = [canonical(model, chat, chat.messages[:k]) for k in (1, 3, 5)]
    for t in (1, 2):
        new = len(prompts[t]) - (len(prompts[t - 1]) + 4)  # the previous state held prompt + 4 generated
        assert computed[t] == new + 4, (computed, new)
    assert computed[2] < len(prompts[2]) / 2


def test_adding_messages_computes_nothing():
    model, chat = chat_for("smollm2")
    counter, handle = count_forward_tokens(model)
    try:
        c = chat.user("hi").reply(generate.text(model, samplers.greedy()), max_tokens=2)
        n = counter["tokens"]
        c2 = c.user("again").system("be brief").user("ok")
        assert counter["tokens"] == n and c2.state is c.state and len(c.messages) == 2
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------ history rewrites
def test_qwen3_drops_earlier_reasoning_and_the_chat_recomputes_from_there():
    model, chat = chat_for("qwen3")
    gen = generate.text(model, samplers.greedy())
    think = "<think>\nLet me think.\n</think>\n\n"
    c1 = chat.user("What is 2+2?").assistant(think).reply(gen, max_tokens=4)
    assert c1.messages[-1]["content"].startswith(think)  # the prefill is continued, then kept
    prompt1 = canonical(model, chat.user("What is 2+2?").assistant(think))
    assert row_ids(c1.state)[:len(prompt1)] == prompt1
    c2 = c1.user("And 3+3?")
    assert "Let me think." not in c2.render()  # the template dropped the earlier reasoning
    chat2, computed = greedy_turns("qwen3", ["And 3+3?"], chat=c1, model=model)
    old, new = row_ids(c1.state), canonical(model, c2)
    lcp = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    assert "<think>" in model.tokenizer.hf.decode(old[lcp:lcp + 3])  # the first changed token opens the reasoning
    assert computed[0] == len(new) - lcp + 4  # recomputed from there, nothing before


def test_llama3_trims_a_reply_and_the_chat_recomputes_from_the_reply():
    model, chat = chat_for("llama-3-instruct")
    c1 = chat.user("Say a word.").reply(generate.regex(model, r" [a-z]{3} ", samplers.greedy()))
    content = c1.messages[-1]["content"]
    assert content.startswith(" ") and content.endswith(" ") and c1.value == content
    prompt1 = canonical(model, chat.user("Say a word."))
    assert row_ids(c1.state) == prompt1 + row_ids(c1.state)[len(prompt1):]
    c2 = c1.user("Another.")
    assert content.strip() + "<|eot_id|>" in model.tokenizer.hf.decode(canonical(model, c2))  # trimmed when rendered
    c3, computed = greedy_turns("llama-3-instruct", ["Another."], chat=c1, model=model, max_tokens=3)
    new = canonical(model, c2)
    assert new[:len(prompt1)] == prompt1 and row_ids(c1.state)[len(prompt1)] != new[len(prompt1)]
    assert computed[0] == len(new) - len(prompt1) + 2  # from the reply's first token on


# ------------------------------------------------------------------------------------ end of turn
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_end_of_turn_marker_is_read_from_the_template(name):
    model, chat = chat_for(name)
    ids, texts = chat._setup.end_of_turn()
    tok = model.tokenizer.hf
    expected = {"smollm2": "<|im_end|>", "qwen2.5-instruct": "<|im_end|>", "qwen3": "<|im_end|>",
                "llama-3-instruct": "<|eot_id|>", "mistral-instruct": "</s>"}
    if name in expected:
        assert ids == {tok.convert_tokens_to_ids(expected[name])} and texts == ()
    else:  # <end_of_turn> is plain text for a tokenizer without it as a special token: a stop string
        assert ids == frozenset() and texts == ("<end_of_turn>",)


def _model_ending_at(token: int, tok_name: str, prompt: list[int], step: int = 2):
    """A fresh tiny model whose greedy reply to ``prompt`` emits ``token`` (instead of what it would
    generate) at about ``step``: that token's LM-head row is a scaled copy of the winner's row."""
    model = tiny(tok_name, fresh=True)
    winner = hf_greedy(model, prompt, step + 1, [])[step]
    with torch.no_grad():
        w = model.model.get_output_embeddings().weight
        w[token] = w[winner] * 1.5
    return model


def test_a_text_reply_stops_at_the_end_of_turn_token_and_does_not_keep_it():
    tok_name, tpl = TEMPLATES["smollm2"], template("smollm2")
    base = tiny(tok_name)
    eot = base.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    prompt = canonical(base, Chat(base, template=tpl).user("Hi"))
    model = _model_ending_at(eot, tok_name, prompt)
    chat = Chat(model, template=tpl)
    c, computed = greedy_turns("smollm2", ["Hi", "Hi again"], chat=chat, model=model, max_tokens=12)
    assert c[0].state is c.state
    first = Chat(model, template=tpl).user("Hi").reply(generate.text(model, samplers.greedy()), max_tokens=12)
    assert first.finish_reason == "eos" and first.value.finish_reason == "eos"
    generated = row_ids(first.state)[len(prompt):]
    assert 0 < len(generated) < 12 and eot not in generated
    assert c.messages[:2] == first.messages
    assert first.messages[-1]["content"] + "<|im_end|>" in first.user("x").render()  # the next rendering closes the turn


def test_a_text_end_of_turn_marker_is_cut_from_the_reply_and_the_stream():
    # a template whose turns end with plain text ("###"), as Gemma's <end_of_turn> is for a tokenizer
    # without that special token: the marker is a stop string, cut from the reply (cache kept)
    tpl = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}###\n{% endfor %}"
           "{% if add_generation_prompt %}assistant:{% endif %}")
    tok_name = TEMPLATES["smollm2"]
    base = tiny(tok_name)
    mark = base.tokenizer.hf("###", add_special_tokens=False)["input_ids"]
    assert len(mark) == 1
    prompt = canonical(base, Chat(base, template=tpl).user("Hi"))
    model = _model_ending_at(mark[0], tok_name, prompt)
    chat = Chat(model, template=tpl).user("Hi")
    assert chat._setup.end_of_turn() == (frozenset(), ("###",))
    gen = generate.text(model, samplers.greedy())
    c = chat.reply(gen, max_tokens=12)
    assert c.finish_reason == "eos" and "###" not in c.messages[-1]["content"]
    ids = row_ids(c.state)
    expected = hf_greedy(model, prompt, 12, mark)
    assert ids == prompt + expected and model.tokenizer.decode(ids).endswith(c.value)
    assert int(c.state.cached_tokens) == len(ids) - 1  # cut behind the marker, the cache kept
    stream = chat.stream_reply(gen, max_tokens=12)
    chunks = list(stream)
    assert "".join(chunks) == c.value and row_ids(stream.chat.state) == ids
    c2 = c.user("More").reply(gen, max_tokens=3)
    assert row_ids(c2.state)[:len(canonical(model, c.user("More")))] == canonical(model, c.user("More"))


# ------------------------------------------------------------------------------------ errors
def test_gemma_refuses_a_system_turn_and_the_chat_is_unchanged():
    model = tiny(TEMPLATES["gemma-it"])
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        Chat(model, system="Be nice.", template=template("gemma-it"))
    chat = Chat(model, template=template("gemma-it"))
    with pytest.raises(ChatTemplateError, match="System role not supported") as info:
        chat.system("Be nice.")
    assert isinstance(info.value, ValueError)
    assert chat.messages == []
    c = chat.user("Hi").reply(generate.text(model, samplers.greedy()), max_tokens=2)
    assert [m["role"] for m in c.messages] == ["user", "assistant"]


def test_mistral_refuses_non_alternating_roles_and_the_chat_is_unchanged():
    model, chat = chat_for("mistral-instruct")
    c = chat.user("Hi")
    with pytest.raises(ChatTemplateError, match="must alternate"):
        c.user("Hi again")
    with pytest.raises(ChatTemplateError, match="must alternate"):
        c.assistant("a").assistant("b")
    assert c.messages == [{"role": "user", "content": "Hi"}]
    c2 = c.reply(generate.text(model, samplers.greedy()), max_tokens=2)
    assert [m["role"] for m in c2.messages] == ["user", "assistant"]


def test_bad_inputs_get_clear_errors():
    model = tiny(TEMPLATES["smollm2"])
    with pytest.raises(ChatTemplateError, match="no chat template: pass one"):
        Chat(model)  # the fixture tokenizer ships no chat template
    chat = Chat(model, template=template("smollm2"))
    with pytest.raises(ContinuumTypeError, match="must be a str"):
        chat.user({"text": "hi"})
    with pytest.raises(ContinuumTypeError, match="decode bytes"):
        chat.user(b"hi")
    with pytest.raises(ChatTemplateError, match="unknown role"):
        chat.message("narrator", "hi")
    with pytest.raises(ChatTemplateError, match="no message"):
        chat.reply(generate.text(model))
    with pytest.raises(ValueError, match="no reply yet"):
        chat.user("hi").value
    with pytest.raises(ContinuumTypeError, match="generator"):
        chat.user("hi").reply("not a generator")
    from continuum.errors import GeneratorArgumentError

    with pytest.raises(GeneratorArgumentError, match="stop_at"):
        chat.user("hi").reply(generate.text(model), stop_at=3)
    from continuum.errors import UnencodableTextError

    with pytest.raises(UnencodableTextError, match="the user message cannot be encoded") as info:
        chat.user("hi \ud800")  # a lone surrogate: named where it was added, not as a template refusal
    assert info.value.position == 3 and chat.messages == []


# ------------------------------------------------------------------------------------ tools
def test_tools_are_rendered_and_tool_turns_keep_the_invariant():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    model, chat = chat_for("qwen2.5-instruct", tools=tools)
    c = chat.user("Weather in Paris?")
    assert "get_weather" in c.render() and "# Tools" in c.render()
    call = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    c = c.assistant("", tool_calls=call).tool('{"temp": 21}')
    assert "<tool_response>" in c.render() and "<tool_call>" in c.render()
    c2, _ = greedy_turns("qwen2.5-instruct", ["Thanks, and Rome?"], chat=c.reply(generate.text(model, samplers.greedy()),
                                                                                  max_tokens=3), model=model, max_tokens=3)
    prompt = canonical(model, c)
    assert prompt == list(model.tokenizer.hf.apply_chat_template(c.messages, chat_template=template("qwen2.5-instruct"),
                                                                   tools=tools, add_generation_prompt=True,
                                                                   tokenize=True, return_dict=False))
    assert c2.messages[1]["tool_calls"] == call and c2.messages[2]["role"] == "tool"


def test_template_kwargs_reach_the_template():
    model, chat = chat_for("qwen3", template_kwargs={"enable_thinking": False})
    c = chat.user("Hi")
    assert c.render().endswith("<think>\n\n</think>\n\n")
    greedy_turns("qwen3", ["Hi again"], chat=c.reply(generate.text(model, samplers.greedy()), max_tokens=3),
                 model=model, max_tokens=3)
