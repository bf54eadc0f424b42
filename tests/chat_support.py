"""Shared pieces of the chat tests (``test_chat_templates.py``, ``test_chat_replies.py``): every fixture chat
template with the fixture tokenizer it pairs with, a tiny random Llama per tokenizer, and the stateless reference.

The reference is what a serving loop without state does at every turn: render the messages with
``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` and run HF ``generate``. Every
reply must continue that prompt template-exactly (the same text; every token outside the model's
earlier replies the canonical one; the replies keep the model's own tokens), greedy replies must
equal HF's on that prompt token for token, turn after turn, and each turn must compute only the
tokens after the longest common prefix with the previous state (counted with a forward hook):
:func:`greedy_turns` checks all of it at every reply.
"""

from __future__ import annotations

import math

import torch

from continuum import generate, models, samplers
from continuum.chat import Chat

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
