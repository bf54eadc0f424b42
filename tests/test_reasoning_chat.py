"""Reasoning in chats (issue 30): thoughts recorded per reply, the two history policies, counted.

References: ``apply_chat_template`` of the equivalent messages (the tokens every reply continues),
and the positions the HF model computes (a forward pre-hook). The model has one token per
character, so a reply re-renders to exactly its tokens and every difference is the policy's.
"""

from __future__ import annotations

import pytest
import torch

from continuum import generate, samplers
from continuum.chat import Chat
from continuum.chat.reasoning import history_for
from continuum.errors import ReasoningError

from conftest import count_forward_tokens, fixture_path

QWEN3 = fixture_path("chat_templates", "qwen3.jinja").read_text()


def canonical(model, messages, **kw) -> list[int]:
    return list(model.tokenizer.hf.apply_chat_template(messages, chat_template=QWEN3, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False, **kw))


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def generated(state) -> int:
    ids, lps = state._real_rows()[0]
    k = len(ids)
    while k > 0 and lps[k - 1] == lps[k - 1]:
        k -= 1
    return len(ids) - k


@pytest.mark.parametrize("keep", [False, True])
def test_turns_render_as_the_template_and_compute_only_what_the_policy_changes(think_char_model, keep):
    model = think_char_model
    think = model.tokenizer.hf.convert_tokens_to_ids("<think>")
    chat = Chat(model, template=QWEN3, reasoning=True, keep_reasoning=keep, thinking_budget=24)
    gen = generate.regex(model, r"[0-9]{2}", samplers.greedy())
    old: list[int] = []
    for turn, question in enumerate(["What is 2+2?", "And 3+3?", "And 4+4?", "Done?"]):
        chat = chat.user(question)
        messages = history_for(chat.messages, ("<think>", "</think>") if keep else None)
        new = canonical(model, messages, enable_thinking=True)  # the equivalent messages, rendered stateless
        counter, handle = count_forward_tokens(model.model)
        try:
            chat = chat.reply(gen, max_tokens=48)
        finally:
            handle.remove()
        ids = chat.state._real_rows()[0][0]
        assert ids[:len(new)] == new  # the reply continues exactly the template's tokens
        shared = lcp(old, new)
        assert chat.recomputed == len(new) - min(shared, max(len(old) - 1, 0))
        assert counter["tokens"] == chat.recomputed + generated(chat.state)  # each position once (the last: its forward ran)
        if turn and keep:  # the previous state is a prefix up to its thought's end at least: the template writes
            # "\n</think>" (as a budget cut does); a random model that wrote "</think>" itself, mid-line, re-renders
            # from there
            end = len(old) - 1 - old[::-1].index(model.tokenizer.hf.convert_tokens_to_ids("</think>"))
            newline = model.tokenizer.hf.encode("\n")[0]
            assert shared == len(old) if old[end - 1] == newline else shared == end
        elif turn:  # the template dropped the earlier thought: recomputed from its <think>
            assert old[shared] == think
        msg = chat.messages[-1]
        assert msg["reasoning_content"] == chat.state.reasoning and msg["content"] == chat.value
        assert "<think>" not in msg["content"] and len(chat.value) == 2
        old = ids


def test_reasoning_off_closes_the_thought_in_the_template(think_char_model):
    model = think_char_model
    chat = Chat(model, template=QWEN3, reasoning=False).user("Hi")
    assert chat.render().endswith("<think>\n\n</think>\n\n")  # enable_thinking=False passed through
    c = chat.reply(generate.regex(model, r"[a-z]{3}", samplers.greedy()))
    assert "reasoning_content" not in c.messages[-1] and len(c.value) == 3
    # a reply may still ask for a thought: the prompt already closed it, so the constraint applies from token 0
    c = chat.reply(generate.regex(model, r"[a-z]{3}", samplers.greedy()), reasoning=True)
    assert c.messages[-1]["reasoning_content"] == "" and len(c.value) == 3


def test_a_reply_can_think_in_a_chat_that_does_not_by_default(think_char_model):
    model = think_char_model
    chat = Chat(model, template=QWEN3).user("Tell me.")
    c = chat.reply(generate.text(model, samplers.multinomial(2)), max_tokens=40, reasoning=True, thinking_budget=6,
                   rng=torch.Generator().manual_seed(0))
    for row in range(2):
        msg = c[row].messages[-1]
        assert msg["reasoning_content"] == c.state.reasoning[row]
        assert len(msg["reasoning_content"]) <= 7 and "think>" not in msg["content"]
    assert c.finish_reason == ["thinking_budget", "thinking_budget"] or "length" in c.finish_reason
    with pytest.raises(ReasoningError, match="thinking_budget must be"):
        chat.reply(generate.text(model), reasoning=True, thinking_budget=-1)
    with pytest.raises(ReasoningError, match="needs reasoning"):  # nothing asked for a thought
        chat.reply(generate.text(model), thinking_budget=4)
    own = chat.reply(generate.text(model, samplers.greedy(), reasoning=True), max_tokens=30, thinking_budget=3)
    assert len(own.messages[-1]["reasoning_content"]) <= 4  # the generator thinks; the reply's budget applies
