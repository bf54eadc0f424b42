"""Token healing with real tokenizers: the first token re-covers the removed text; outputs and caches stay exact."""

from __future__ import annotations

import math
import re

import pytest
import torch

from continuum import continuous, generate, samplers
from continuum.loop.healing import candidates

from conftest import assert_reuse_exact

PROMPT = "Visit https:"


@pytest.fixture(scope="module", params=["gpt2", "llama3-bpe"])
def tmodel(request):
    """A tiny random Llama over a real byte-level tokenizer (seeded: the same model in every test)."""
    from transformers import AutoTokenizer

    from continuum import models

    from conftest import fixture_path, tiny_llama

    tok = AutoTokenizer.from_pretrained(str(fixture_path("tokenizers", request.param)))
    hf = tiny_llama(len(tok), bos=tok.bos_token_id or 0, eos=tok.eos_token_id)
    return models.Transformers(hf, tok)


def brute_candidates(tok, token: int) -> set[int]:
    """Independent reference: every vocabulary entry whose bytes start with ``token``'s."""
    prefix = tok.token_bytes(tok.hf.convert_ids_to_tokens(token))
    out = set()
    for piece, idx in tok.hf.get_vocab().items():
        data = tok.token_bytes(piece)
        if idx not in tok.special_ids and data and data.startswith(prefix):
            out.add(idx)
    return out


def hf_next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_healed_first_token_starts_with_the_removed_text(tmodel):
    tok = tmodel.tokenizer
    prompt_ids = tok.encode_prompts([PROMPT])[0]
    removed = prompt_ids[-1]
    allowed = brute_candidates(tok, removed)
    assert set(candidates(tok, removed)) == allowed and any(tok.vocab_bytes[i].startswith(b"://") for i in allowed)
    state = continuous(generate.text(tmodel, samplers.greedy(), token_healing=True))(PROMPT, max_tokens=4)
    (text,), ids = list(state), state.token_ids[0][state.attention_masks[0].bool()].tolist()
    assert text.startswith(PROMPT) and state.last_text == text[len(PROMPT):]
    assert ids[:len(prompt_ids) - 1] == prompt_ids[:-1]
    first = ids[len(prompt_ids) - 1]
    assert tok.vocab_bytes[first].startswith(b":")
    logits = hf_next_logits(tmodel, prompt_ids[:-1])  # the best allowed token after the backed-up prompt
    assert first == max(allowed, key=lambda i: float(logits[i]))
    assert_reuse_exact(state)
    # the weights are the raw log-probs of the generated tokens, the healed one included
    lp = torch.log_softmax(logits, -1)[first]
    assert math.isclose(float(state.token_logprobs[0][-len(ids) + len(prompt_ids) - 1]), float(lp), abs_tol=1e-4)


def test_healing_off_is_unchanged(tmodel):
    prompt_ids = tmodel.tokenizer.encode_prompts([PROMPT])[0]
    state = continuous(generate.text(tmodel, samplers.greedy()))(PROMPT, max_tokens=1)
    ids = state.token_ids[0][state.attention_masks[0].bool()].tolist()
    assert ids[:-1] == prompt_ids and ids[-1] == int(hf_next_logits(tmodel, prompt_ids).argmax())
    off = generate.text(tmodel, samplers.greedy(), token_healing=False)(PROMPT, max_tokens=4)
    assert off == generate.text(tmodel, samplers.greedy())(PROMPT, max_tokens=4)


def test_healing_with_a_regex(tmodel):
    pattern = r"//[a-z]{2,6}\.(com|org)"
    gen = continuous(generate.regex(tmodel, pattern, samplers.greedy(), token_healing=True))
    state = gen([PROMPT, "Go to http:"], max_tokens=20)
    for full, prompt, out in zip(list(state), [PROMPT, "Go to http:"], state.value):
        assert full == prompt + out and re.fullmatch(pattern, out)
    assert_reuse_exact(state)
    sampled = generate.regex(tmodel, pattern, samplers.multinomial(3), token_healing=True)
    for seed in range(3):
        for out in sampled(PROMPT, max_tokens=20, rng=torch.Generator().manual_seed(seed)):
            assert re.fullmatch(pattern, out)


def test_healing_in_continuous_mode(tmodel):
    text_c = continuous(generate.text(tmodel, samplers.greedy()))
    heal_c = continuous(generate.text(tmodel, samplers.greedy(), token_healing=True))
    base = text_c("Links", max_tokens=3)
    before = base + " https:"
    state = heal_c(before, max_tokens=4)
    assert list(state)[0].startswith(list(before)[0]) and state.last_text == list(state)[0][len(list(before)[0]):]
    assert_reuse_exact(state)
    # healing a generated last token: its log-prob leaves the weights, the new ones come in
    healed = heal_c(base, max_tokens=3)
    assert list(healed)[0].startswith(list(base)[0])
    tlp = healed.token_logprobs[0]
    assert math.isclose(float(healed.weights.flatten()[0]), float(tlp[~tlp.isnan()].sum()), abs_tol=1e-4)
    ids, mask = healed.token_ids, healed.attention_masks
    with torch.no_grad():
        ref = torch.log_softmax(tmodel.model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    cols = (~tlp.isnan()).nonzero().flatten()
    torch.testing.assert_close(tlp[cols], ref[0, cols - 1, ids[0, cols]], atol=1e-4, rtol=0)
    assert_reuse_exact(healed)


def test_healing_stream_beams_and_choice(tmodel):
    gen = generate.text(tmodel, samplers.greedy(), token_healing=True)
    stream = gen.stream(PROMPT, max_tokens=4)
    assert "".join(stream) == stream.result == gen(PROMPT, max_tokens=4)
    for full in continuous(generate.text(tmodel, samplers.beam_search(2), token_healing=True))(PROMPT, max_tokens=3):
        assert full.startswith(PROMPT)
    options = ["//a.com", "//b.org", "//www.c.net"]
    for method in ("exact", "greedy"):
        state = continuous(generate.choice(tmodel, options, samplers.greedy(), method=method, token_healing=True))(PROMPT)
        assert state.value in options and list(state)[0] == PROMPT + state.value
        assert_reuse_exact(state)


def test_no_healing_without_a_longer_token(tmodel):
    tok = tmodel.tokenizer
    assert candidates(tok, tok.eos_token_id) is None  # special tokens are never healed
    longest = max((i for i, b in enumerate(tok.vocab_bytes) if b), key=lambda i: len(tok.vocab_bytes[i]))
    if not brute_candidates(tok, longest) - {longest}:
        assert candidates(tok, longest) is None
    assert candidates(tok, longest) is candidates(tok, longest) or candidates(tok, longest) is None
