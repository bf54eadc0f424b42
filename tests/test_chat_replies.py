"""Chat sessions (issue 15) against a stateless reference loop: the kinds of replies.

Every reply must still continue the stateless prompt (``apply_chat_template`` + HF ``generate``) template-exactly
and compute only the tokens after the longest common prefix with the previous state: choice and JSON replies ending
with their constraint (a constrained reply's own tokens kept next turn, ``own_tokens``), forks and beams continuing
each row's own history across turns, streamed replies giving the same chat, a 200-turn chat keeping memory flat,
and the HTML rendering. The invariant on every template, history rewrites, end-of-turn markers, refusals and
tools: ``test_chat_templates.py``; the templates, the tiny models and the reference: ``chat_support.py``.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from continuum import generate, samplers
from continuum.errors import SampleMismatch

from chat_support import TEMPLATES, canonical, chat_for, check_logprobs, greedy_turns, row_ids, template_exact, text_added, tiny
from conftest import count_forward_tokens


# ------------------------------------------------------------------------------------ constrained replies
def test_choice_and_json_replies_end_with_their_constraint():
    model, chat = chat_for("smollm2")
    colors = [" red", " green", " blue"]
    c = chat.user("Pick a color.").reply(generate.choice(model, colors, samplers.greedy()))
    assert c.value in colors and c.messages[-1]["content"] == c.value and c.finish_reason == "pattern"
    prompt = canonical(model, chat.user("Pick a color."))
    assert row_ids(c.state) == prompt + row_ids(c.state)[len(prompt):]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    c2 = c.user("Now as JSON.").reply(generate.json(model, schema, samplers.greedy(), whitespace_pattern=""), max_tokens=10)
    assert isinstance(c2.value, dict) and set(c2.value) == {"ok"} and c2.finish_reason == "pattern"
    import json as _json

    assert _json.loads(c2.messages[-1]["content"]) == c2.value
    prompt2 = canonical(model, c.user("Now as JSON."))
    assert row_ids(c2.state)[:len(prompt2)] == prompt2
    greedy_turns("smollm2", ["Thanks."], chat=c2, model=model, max_tokens=3)  # the invariant goes on
    check_logprobs(c2.state)


def test_own_tokens_keeps_an_unchanged_reply_and_nothing_else():
    from continuum.chat.reuse import own_tokens

    tok = tiny(TEMPLATES["qwen2.5-instruct"]).tokenizer
    enc = lambda t: list(tok.hf(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    head, reply = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "Hello world"
    tail = "<|im_end|>\n<|im_start|>user\nMore"
    split = [t for ch in reply for t in enc(ch)]  # one token per character: not the canonical split
    assert split != enc(reply)
    ids, lps = enc(head) + split, [math.nan] * len(enc(head)) + [-1.0] * len(split)
    prompt = enc(head + reply + tail)
    out = own_tokens(tok, ids, lps, prompt)
    assert out == ids + enc(tail) and tok.decode(out, skip_special=False) == tok.decode(prompt, skip_special=False)
    # the template changed the reply (or the tokens were never generated: NaN): the canonical rendering
    assert own_tokens(tok, ids, lps, enc(head + "Hello World" + tail)) == enc(head + "Hello World" + tail)
    assert own_tokens(tok, ids, [math.nan] * len(ids), prompt) == prompt


@pytest.mark.parametrize("name", ["smollm2", "llama-3-instruct"])
def test_a_constrained_reply_keeps_the_models_tokens_next_turn(name):
    # JSON chosen under the grammar is not the tokenizer's canonical split of the same text: the next turn
    # keeps the reply's generated tokens (template-exact), so it reuses the whole previous state's cache
    model, chat = chat_for(name)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    c = chat.user("A card as JSON").reply(generate.json(model, schema, samplers.greedy()), max_tokens=40)
    ids = row_ids(c.state)
    assert canonical(model, c.user("Thanks."))[:len(ids)] != ids, "precondition: the reply is not in its canonical split"
    c2, _ = greedy_turns(name, ["Thanks."], chat=c, model=model, max_tokens=3)  # template-exact, equal to HF
    new = row_ids(c2.state)
    lps = c2.state.token_logprobs[0][c2.state.attention_masks[0].bool()].tolist()
    prompt = next(i for i in range(len(lps), 0, -1) if math.isnan(lps[i - 1]))
    assert new[:len(ids)] == ids  # the model's own tokens, kept
    assert c2.recomputed == prompt - int(c.state.cached_tokens.flatten()[0])  # the whole previous cache reused
    check_logprobs(c2.state)


# ------------------------------------------------------------------------------------ forks, beams, streams
def test_forks_continue_each_rows_own_history_across_turns():
    model, chat = chat_for("qwen2.5-instruct")
    gen = generate.text(model, samplers.multinomial(2))
    rng = torch.Generator().manual_seed(0)
    c = chat.user("Hi").reply(gen, max_tokens=4, rng=rng)
    assert c.rows == 2 and len(c.messages) == 2 and isinstance(c.value, list)
    c = c.user("More").reply(gen, max_tokens=3, rng=rng)
    for r in range(2):
        row = c[r]
        assert row.rows == 1 and row.messages == c.messages[r]
        prompt = canonical(model, row, c.messages[r][:-1])
        ids = row_ids(c.state, r)
        lps = c.state.token_logprobs[r][c.state.attention_masks[r].bool()].tolist()
        new = next(i for i in range(len(lps), 0, -1) if math.isnan(lps[i - 1]))  # the last reply starts there
        # (a sampled reply is often not its text's canonical split: the first reply keeps the model's own tokens)
        template_exact(model, ids[:new], lps[:new], prompt)
        assert text_added(model, ids[:new], ids[new:]) == c.messages[r][-1]["content"]
        assert row_ids(row.state) == ids
    check_logprobs(c.state)
    with pytest.raises(SampleMismatch):
        c.user("x").reply(generate.text(model, samplers.multinomial(3)), max_tokens=2)
    one = c[1].user("Only you.").reply(generate.text(model, samplers.greedy()), max_tokens=2)
    assert one.rows == 1 and one.messages[:-2] == c.messages[1]


def test_beams_continue_across_turns_best_first():
    model, chat = chat_for("llama-3-instruct")
    gen = generate.text(model, samplers.beam_search(2))
    c = chat.user("Hi").reply(gen, max_tokens=3).user("More").reply(gen, max_tokens=3)
    assert c.rows == 2
    w = c.state.weights.flatten().tolist()
    assert w[0] >= w[1]
    for r in range(2):
        prompt = canonical(model, c[r], c.messages[r][:-1])
        ids = row_ids(c.state, r)
        assert ids[:len(prompt)] == prompt
        assert text_added(model, prompt, ids[len(prompt):]) == c.messages[r][-1]["content"]
    check_logprobs(c.state)
    assert "rows=2" in repr(c) and "row 0 shown" in repr(c)


def test_streaming_yields_the_reply_and_gives_the_same_chat():
    model, chat = chat_for("smollm2")
    gen = generate.text(model, samplers.greedy())
    c = chat.user("Hi")
    stream = c.stream_reply(gen, max_tokens=6)
    with pytest.raises(RuntimeError):
        stream.chat
    chunks = list(stream)
    done = c.reply(gen, max_tokens=6)
    assert all(isinstance(x, str) for x in chunks) and "".join(chunks) == done.value
    assert stream.chat.messages == done.messages and row_ids(stream.chat.state) == row_ids(done.state)
    forked = c.stream_reply(generate.text(model, samplers.multinomial(2)), max_tokens=4, rng=torch.Generator().manual_seed(1))
    parts = list(forked)
    joined = ["".join(p[r] for p in parts) for r in range(2)]
    assert joined == [m[-1]["content"] for m in forked.chat.messages]


# ------------------------------------------------------------------------------------ long chats
@pytest.mark.slow
def test_a_200_turn_chat_keeps_memory_flat():
    """200 short turns: each turn computes only its new tokens, and the tensor memory the process holds
    stays proportional to the chat's tokens (dropped states free their KV storage)."""
    from test_soak import parameter_storages, process_tensor_bytes, reachable_bytes

    model, chat = chat_for("smollm2")
    gen = generate.text(model, samplers.greedy())
    params = parameter_storages(model)
    counter, handle = count_forward_tokens(model)
    sizes, computed = {}, []
    try:
        for turn in range(1, 201):
            n0 = counter["tokens"]
            chat = chat.user(f"Turn {turn}.").reply(gen, max_tokens=1)
            computed.append(counter["tokens"] - n0)
            if turn in (50, 200):
                gc.collect()
                sizes[turn] = (len(row_ids(chat.state)), process_tensor_bytes(params)[1], reachable_bytes([chat.state])[0])
    finally:
        handle.remove()
    (t50, held50, reach50), (t200, held200, reach200) = sizes[50], sizes[200]
    print(f"\nchat soak: positions per turn {min(computed[1:])}-{max(computed[1:])}; tokens {t50} -> {t200}; "
          f"bytes reachable from the state per token {reach50 / t50:.0f} -> {reach200 / t200:.0f}; process tensor "
          f"bytes grew {(held200 - held50) / 2**20:.2f} MiB while the state grew {(reach200 - reach50) / 2**20:.2f} MiB")
    assert max(computed[1:]) <= 20  # ~15 new tokens a turn, whatever the chat's length (~3,000 tokens)
    assert reach200 / t200 <= 1.5 * reach50 / t50  # the state holds KV for its tokens, nothing per turn
    assert held200 - held50 <= 1.5 * (reach200 - reach50) + 2**20  # nothing else grows: dropped states are freed
    assert len(chat.messages) == 400


def test_a_chat_renders_as_html_turns_with_the_reply_shaded():
    from html.parser import HTMLParser

    model, chat = chat_for("smollm2")
    assert "Hi &lt;b&gt;" in chat.user("Hi <b>").to_html()  # before any reply: turns as escaped text
    c = chat.user("Hi <b>").reply(generate.text(model, samplers.multinomial(2)), max_tokens=4,
                                  rng=torch.Generator().manual_seed(0))
    markup = c._repr_html_()
    HTMLParser().feed(markup)
    assert "Hi &lt;b&gt;" in markup and "Hi <b>" not in markup
    assert markup.count("data-row") >= 2  # both samples' replies drawn from the state
    later = c.user("More")
    HTMLParser().feed(later.to_html())
    assert "More" in later.to_html()
