"""Speculative decoding on states (continuum.speculate): drafted tokens verified in the step's one forward.

The reference is the same call without speculation on the same model (transformers fp32: texts equal, weights within
1e-4; the llama.cpp f32 fixture in the batch-invariant mode: the same), and brute force for the n-gram lookup."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from continuum import SequenceState, continuous, generate, run_batch, samplers, speculate
from continuum.errors import GeneratorArgumentError
from continuum.speculate import Lookup

DOC = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, she saw "
       "a big red ball.")
COPY = DOC + " Again: " + DOC[:40]  # the model re-states the document: drafts from the prompt are right
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "story": {"type": "string", "maxLength": 200}}, "required": ["name", "story"]}


def _pair(make):
    return continuous(make()), continuous(make(speculate=speculate.lookup()))


def _same(a, b, tol=1e-4):
    assert list(a) == list(b)
    assert torch.allclose(a.weights, b.weights, atol=tol, rtol=0)


GENERATORS = {
    "text": lambda m, **k: generate.text(m, samplers.greedy(), **k),
    "regex": lambda m, **k: generate.regex(m, r"( [A-Za-z]+[,.]?){5,40}", samplers.greedy(), **k),
    "json": lambda m, **k: generate.json(m, SCHEMA, samplers.greedy(), **k),
    "cfg": lambda m, **k: generate.cfg(m, 'start: WORD (" " WORD)*\nWORD: /[a-z]+/', samplers.greedy(), **k),
}


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_greedy_equals_the_same_call_without_speculation(stories, kind):
    plain, spec = _pair(lambda **k: GENERATORS[kind](stories, **k))
    a, b = plain(COPY, max_tokens=80), spec(COPY, max_tokens=80)
    _same(a, b)
    stats = b._last.speculation
    assert stats["accepted"] > 0 and stats["accepted"] <= stats["drafted"]
    if kind == "json":
        jsonschema.validate(b.value, SCHEMA)


def test_fewer_forwards_where_the_text_repeats_its_context(stories):
    spec = continuous(generate.text(stories, samplers.greedy(), speculate=speculate.lookup()))
    stats = spec(COPY, max_tokens=80)._last.speculation
    assert stats["forwards"] + stats["accepted"] == 80 - 1  # (the first token comes from the prefill)
    assert stats["forwards"] < 80 - 10


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 33])
def test_max_tokens_and_stop_strings_are_exact(stories, max_tokens):
    plain, spec = _pair(lambda **k: generate.text(stories, samplers.greedy(), **k))
    _same(plain(COPY, max_tokens=max_tokens), spec(COPY, max_tokens=max_tokens))
    a, b = plain(COPY, max_tokens=80, stop_at=["ball", "sun"]), spec(COPY, max_tokens=80, stop_at=["ball", "sun"])
    _same(a, b)
    assert b._last.finish == a._last.finish


def test_run_batch_and_list_calls_equal_each_call_alone(stories):
    gen = continuous(generate.text(stories, samplers.greedy(), speculate=speculate.lookup()))
    prompts = [COPY, DOC, "Tom had a red ball. Tom had a red ball. Tom"]
    alone = [gen(p, max_tokens=40) for p in prompts]
    together = run_batch(lambda p: gen(p, max_tokens=40), prompts)
    listed = gen(prompts, max_tokens=40)
    for i, a in enumerate(alone):
        assert str(together[i]) == str(a) == list(listed)[i]
        assert torch.allclose(together[i].weights, a.weights, atol=1e-4)


def test_the_state_continues_slices_and_saves_exactly(stories, tmp_path):
    plain, spec = _pair(lambda **k: generate.text(stories, samplers.greedy(), **k))
    a, b = plain(COPY, max_tokens=30), spec(COPY, max_tokens=30)
    _same(a, b)
    _same(plain(a + " Then", max_tokens=20), spec(b + " Then", max_tokens=20))
    cut = len(str(b)) // 2
    _same(plain(a[:cut], max_tokens=20), spec(b[:cut], max_tokens=20))
    b.save(tmp_path / "s.safetensors")
    loaded = SequenceState.load(tmp_path / "s.safetensors", stories)
    _same(plain(a, max_tokens=20), spec(loaded, max_tokens=20))


def test_one_row_of_multinomial_draws_exactly_the_tokens_of_the_same_seed(stories):
    """Verification draws once per kept token, in order, from the same conditional distribution as the plain loop: a
    single row with the same seed gets the same tokens (the distribution is exactly the sampler's)."""
    plain, spec = _pair(lambda **k: generate.text(stories, samplers.multinomial(temperature=0.7), **k))
    for seed in range(3):
        a = plain(COPY, max_tokens=60, rng=torch.Generator().manual_seed(seed))
        b = spec(COPY, max_tokens=60, rng=torch.Generator().manual_seed(seed))
        _same(a, b)


def test_sampled_json_under_speculation_is_always_valid(stories):
    gen = continuous(generate.json(stories, SCHEMA, samplers.multinomial(4), speculate=speculate.lookup()))
    for seed in range(3):
        out = gen(COPY, max_tokens=120, rng=torch.Generator().manual_seed(seed))
        texts = out.last_text if isinstance(out.last_text, list) else [out.last_text]
        assert len(texts) == len(out._last.complete) == 4
        for text, complete in zip(texts, out._last.complete):  # (a row cut by max_tokens is incomplete, not wrong:
            if complete:                                         # .value would raise for the whole batch)
                jsonschema.validate(json.loads(text), SCHEMA)


def test_beams_and_bad_speculators_are_refused(stories):
    with pytest.raises(GeneratorArgumentError, match="beam search"):
        generate.text(stories, samplers.beam_search(2), speculate=speculate.lookup())
    with pytest.raises(GeneratorArgumentError, match="speculate"):
        generate.text(stories, samplers.greedy(), speculate="lookup")
    with pytest.raises(GeneratorArgumentError, match="max_draft"):
        speculate.lookup(max_draft=0)


def _brute(h: list[int], limit: int, ngram: int, low: int) -> list[int]:
    n = len(h)
    for k in range(min(ngram, n - 1), low - 1, -1):
        for i in range(n - k - 1, -1, -1):
            if h[i:i + k] == h[n - k:]:
                return h[i + k:i + k + limit]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(0, 10), st.integers(1, 4), st.integers(1, 4))
def test_lookup_drafts_what_followed_the_latest_earlier_occurrence(history, limit, ngram, low):
    low = min(low, ngram)
    got = Lookup(ngram=ngram, max_draft=8, min_ngram=low).draft(np.array(history), limit)
    assert got == _brute(history, min(limit, 8), ngram, low)


def _agree_up_to_a_tie(a, b) -> None:
    """llama.cpp: a token inside a verify batch vs the same token decoded alone differ within ``DECODE_TOL`` (one
    batch vs one token): the two rows are equal, or first differ where llama-cpp-python's own evaluation of the
    plain row has a top-2 margin within that tolerance."""
    from llamacpp_support import DECODE_TOL, reference_logits, row_ids

    x, y = row_ids(a), row_ids(b)
    j = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
    if j is None:
        assert len(x) == len(y)
        return
    top2 = np.sort(reference_logits("f32", x[:j])[-1])[-2:]
    assert top2[1] - top2[0] <= DECODE_TOL["f32"], f"token {j}: {x[j]} vs {y[j]} where the margin is clear"


def test_on_llama_cpp_greedy_and_json_equal_the_call_without_speculation():
    from continuum import models

    from llamacpp_support import gguf

    model = models.llamacpp(gguf("f32"), n_threads=2, batch_invariant=True)
    for kind in ("text", "json"):
        plain, spec = _pair(lambda make=GENERATORS[kind], **k: make(model, **k))
        a, b = plain(COPY, max_tokens=60), spec(COPY, max_tokens=60)
        _agree_up_to_a_tie(a, b)
        assert b._last.speculation["accepted"] > 0
    gen = continuous(generate.text(model, samplers.greedy(), speculate=speculate.lookup()))
    prompts = [COPY, DOC, "Tom had a red ball. Tom had a red ball. Tom"]
    alone = [str(gen(p, max_tokens=40)) for p in prompts]
    assert [str(s) for s in run_batch(lambda p: gen(p, max_tokens=40), prompts)] == alone
    s = gen(COPY, max_tokens=30)
    assert str(gen(s + " Then", max_tokens=20)) == str(continuous(generate.text(model, samplers.greedy()))(
        s + " Then", max_tokens=20))


def test_the_server_speculates_text_and_json_replies_but_not_recorded_ones(stories):
    """``continuum serve --speculate lookup``: its text and JSON generators draft; a request that records log-probs
    decodes one token per step (its records follow the steps)."""
    from continuum.serve.served import Sampling, ServedModel

    served = ServedModel(stories, speculate="lookup")
    greedy = Sampling(temperature=0)
    text, _ = served.generator("text", None, False, greedy, False)
    js, _ = served.generator("json", SCHEMA, True, greedy, False)
    recorded, _ = served.generator("text", None, False, greedy, True)
    assert text.speculate is not None and js.speculate is not None and recorded.speculate is None
    plain = ServedModel(stories).generator("text", None, False, greedy, False)[0]
    _same(continuous(plain)(COPY, max_tokens=40), continuous(text)(COPY, max_tokens=40))


def test_a_speculating_server_reports_kept_and_rejected_drafts_in_its_usage(tmp_path_factory):
    """``continuum serve --speculate lookup`` (a real process, the openai client): OpenAI's
    ``completion_tokens_details.accepted/rejected_prediction_tokens`` count the drafts; the reply is the one a server
    without speculation gives (greedy)."""
    from serve_support import Server, shared_model_dir, shared_server

    model_dir = shared_model_dir(tmp_path_factory)
    spec = Server(model_dir, tmp_path_factory.mktemp("spec") / "store", "--speculate", "lookup")
    try:
        messages = [{"role": "user", "content": "Say it again: " + DOC}]
        got = spec.client().chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0)
        want = shared_server(tmp_path_factory, model_dir).client().chat.completions.create(
            model="tiny", messages=messages, max_tokens=48, temperature=0)
        details = got.usage.completion_tokens_details
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
        assert got.choices[0].message.content == want.choices[0].message.content
        assert want.usage.completion_tokens_details.accepted_prediction_tokens is None
        text = spec.client().completions.create(model="tiny", prompt=COPY, max_tokens=32, temperature=0)
        assert text.usage.completion_tokens_details.accepted_prediction_tokens > 0
    finally:
        spec.stop()
