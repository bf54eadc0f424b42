"""Chat sessions (issue 15) on every fixture chat template, against a stateless reference loop.

The reference is what a serving loop without state does at every turn: render the messages with
``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` and run HF ``generate``. Every
reply must continue that prompt template-exactly (the same text; every token outside the model's
earlier replies the canonical one; the replies keep the model's own tokens), greedy replies must
equal HF's on that prompt token for token, turn after turn, and each turn must compute only the
tokens after the longest common prefix with the previous state (counted with a forward hook).
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from continuum import ChatTemplateError, generate, models, samplers
from continuum.chat import Chat
from continuum.errors import ContinuumTypeError, SampleMismatch

from conftest import _sharpen, count_forward_tokens, fixture_path, tiny_llama

# template -> the fixture tokenizer it pairs with (ChatML: qwen2-bpe; Llama-3: llama3-bpe; Mistral and
# Gemma ship SentencePiece vocabularies: the Llama-2 one is the closest fixture). Gemma twice: gemma3 is
# the official Gemma 3 template (a system message merged into the first user turn), gemma-it an older
# pretty-printed variant (no system role; its whitespace differs between a turn rendered last and the
# same turn inside a longer history, so the chat recomputes from there).
TEMPLATES = {
    "smollm2": "qwen2-bpe", "qwen2.5-instruct": "qwen2-bpe", "qwen3": "qwen2-bpe",
    "llama-3-instruct": "llama3-bpe", "mistral-instruct": "llama2-sentencepiece", "gemma-it": "llama2-sentencepiece",
    "gemma3": "llama2-sentencepiece",
}
NO_SYSTEM_ROLE = {"gemma-it"}  # its template raises on a system message
_MODELS: dict = {}


def template(name: str) -> str:
    return fixture_path("chat_templates", f"{name}.jinja").read_text()


def tiny(tok_name: str, fresh: bool = False):
    """A tiny random Llama over a real fixture tokenizer (cached per tokenizer unless ``fresh``)."""
    if tok_name in _MODELS and not fresh:
        return _MODELS[tok_name]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(fixture_path("tokenizers", tok_name)))
    hf = _sharpen(tiny_llama(len(tok), bos=tok.bos_token_id or 0, eos=tok.eos_token_id, max_positions=4096))
    model = models.Transformers(hf, tok)
    if not fresh:
        _MODELS[tok_name] = model
    return model


def chat_for(name: str, **kw):
    model = tiny(TEMPLATES[name])
    return model, Chat(model, template=template(name), **kw)


# ------------------------------------------------------------------------------------ the reference
def canonical(model, chat: Chat, messages=None, **kw) -> list[int]:
    """The stateless prompt: apply_chat_template of the messages, as a serving loop renders them."""
    messages = chat.messages if messages is None else messages
    cont = messages[-1]["role"] == "assistant"
    return list(model.tokenizer.hf.apply_chat_template(
        messages, chat_template=chat._setup.template, tools=chat._setup.tools, add_generation_prompt=not cont,
        continue_final_message=cont, tokenize=True, return_dict=False, **chat._setup.template_kwargs))


def hf_greedy(model, prompt: list[int], max_new: int, end_ids) -> list[int]:
    """HF generate's greedy tokens after ``prompt``, without the end token it stopped at."""
    eos = sorted(set(end_ids) | set(model.tokenizer.eos_token_ids))
    out = model.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                               pad_token_id=model.tokenizer.pad_token_id)[0, len(prompt):].tolist()
    return out[:-1] if out and out[-1] in eos else out


def text_added(model, prompt: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``prompt`` (how a reply's content is defined)."""
    dec = model.tokenizer.decode
    return dec(prompt + new)[len(dec(prompt)):]


def row_ids(state, r: int = 0) -> list[int]:
    return state.token_ids[r][state.attention_masks[r].bool()].tolist()


def expected_positions(before, prompt: list[int], generated: int, r: int = 0, ended: bool = False) -> int:
    """Positions a turn computes: the prompt after the reusable prefix (the longest common token prefix
    with the previous state, within its cache), then every generated token but the last (also the last
    one when the reply ``ended`` on an end token, whose logits it needed)."""
    keep = 0
    if before is not None:
        old = row_ids(before, r)
        lcp = next((i for i, (a, b) in enumerate(zip(old, prompt)) if a != b), min(len(old), len(prompt)))
        keep = min(lcp, int(before.cached_tokens.flatten()[r]))
    return len(prompt) - keep + (generated if ended else max(generated - 1, 0))


def check_logprobs(state) -> None:
    """Weights are the fresh-forward log-probs of the generated tokens present (NaN elsewhere)."""
    for r in range(state.rows):
        mask = state.attention_masks[r].bool()
        ids, lps = state.token_ids[r][mask], state.token_logprobs[r][mask]
        with torch.no_grad():
            logits = state.model.model(input_ids=ids[None]).logits[0].float()
        fresh = torch.log_softmax(logits, -1)
        gen = (~torch.isnan(lps)).nonzero().flatten()
        for j in gen.tolist():
            assert math.isclose(float(lps[j]), float(fresh[j - 1, ids[j]]), abs_tol=1e-4)
        assert math.isclose(float(state.weights.flatten()[r]), float(lps[gen].sum()), abs_tol=1e-4)


def template_exact(model, ids: list[int], lps: list[float], prompt: list[int]) -> None:
    """``ids`` (a row's prompt, with ``lps``: NaN outside the model's replies) is the template-exact form of
    the canonical ``prompt``: the same text (special tokens included), and every token outside the replies
    is the canonical token at the same place; the replies' tokens are the model's own (checked by the caller)."""
    dec = lambda t: model.tokenizer.decode(t, skip_special=False)  # noqa: E731
    assert dec(ids) == dec(prompt), "the prompt's text is not the template's rendering"
    n = 0
    while n < len(ids):
        end = n
        while end < len(ids) and math.isnan(lps[end]):
            end += 1
        if end > n:  # a run of template tokens: the canonical tokens from the same text offset
            head = dec(ids[:n])
            m = next(m for m in range(len(prompt) + 1) if dec(prompt[:m]) == head)
            assert ids[n:end] == prompt[m:m + end - n], "a token outside the replies is not the template's"
        n = end
        while n < len(ids) and not math.isnan(lps[n]):
            n += 1


def greedy_turns(name: str, turns, max_tokens: int = 5, chat=None, model=None):
    """Run ``turns`` user messages through a greedy chat, checking the invariant at every reply;
    returns the chat and the positions each turn computed."""
    if chat is None:
        model, chat = chat_for(name)
    gen = generate.text(model, samplers.greedy())
    end_ids, _ = chat._setup.end_of_turn()
    counter, handle = count_forward_tokens(model)
    reference, computed = chat.messages, []
    try:
        for user in turns:
            chat = chat.user(user)
            reference = reference + [{"role": "user", "content": user}]
            canon = canonical(model, chat)
            assert canon == canonical(model, chat, reference)
            before, n0 = chat.state, counter["tokens"]
            chat = chat.reply(gen, max_tokens=max_tokens)
            computed.append(counter["tokens"] - n0)
            ids = row_ids(chat.state)
            lps = chat.state.token_logprobs[0][chat.state.attention_masks[0].bool()].tolist()
            new = next(i for i in range(len(lps), 0, -1) if math.isnan(lps[i - 1]))  # the reply starts there
            prompt, generated = ids[:new], ids[new:]
            template_exact(model, prompt, lps[:new], canon)
            assert generated == hf_greedy(model, prompt, max_tokens, end_ids)
            assert computed[-1] == expected_positions(before, prompt, len(generated), ended=chat.finish_reason == "eos")
            reference = reference + [{"role": "assistant", "content": text_added(model, prompt, generated)}]
            assert chat.messages == reference
            assert chat.value == reference[-1]["content"]
    finally:
        handle.remove()
    return chat, computed


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
