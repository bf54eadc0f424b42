"""speculate.draft(model): a draft model of the same vocabulary drafts, the target verifies in its step's forward.

References: the same call without speculation (transformers fp32: the same tokens, weights within 1e-4), and the
draft model's own count of forwards (a draft model with the target's weights proposes exactly the target's greedy
tokens, so every draft is kept)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from continuum import continuous, generate, models, run_batch, samplers, speculate
from continuum.errors import GeneratorArgumentError

from conftest import fixture_path, tiny_llama

PROMPT = "Once upon a time, there was a little girl named Lily. She"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


@pytest.fixture(scope="module")
def twin():
    """The target's weights, loaded again as the draft model (a separate adapter and module)."""
    return models.transformers(str(fixture_path("models", "stories260K")))


def _same(a, b, tol=1e-4):
    assert list(a) == list(b)
    assert torch.allclose(a.weights, b.weights, atol=tol, rtol=0)


def test_a_draft_model_with_the_targets_weights_has_every_draft_kept(stories, twin):
    plain = continuous(generate.text(stories, samplers.greedy()))
    spec = continuous(generate.text(stories, samplers.greedy(), speculate=speculate.draft(twin, max_draft=4)))
    a, b = plain(PROMPT, max_tokens=41), spec(PROMPT, max_tokens=41)
    _same(a, b)
    stats = b._last.speculation
    assert stats["accepted"] == stats["drafted"] == 40 - stats["forwards"]
    assert stats["forwards"] == 8  # 40 tokens after the prefill's: 5 per forward (its token and 4 drafts)


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_constrained_greedy_equals_the_call_without_speculation(stories, twin, kind):
    make = {"json": lambda **k: generate.json(stories, SCHEMA, samplers.greedy(), **k),
            "regex": lambda **k: generate.regex(stories, r"( [a-z]+){3,12}\.", samplers.greedy(), **k)}[kind]
    plain, spec = continuous(make()), continuous(make(speculate=speculate.draft(twin)))
    a, b = plain(PROMPT, max_tokens=60), spec(PROMPT, max_tokens=60)
    _same(a, b)
    assert b._last.speculation["accepted"] > 0
    if kind == "json":
        jsonschema.validate(b.value, SCHEMA)


def test_a_different_draft_model_keeps_the_targets_tokens(stories):
    """A draft model that is wrong often (random weights over the same tokenizer): the output is still the target's."""
    tok = stories.tokenizer.hf
    other = models.Transformers(tiny_llama(len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id), tok)
    plain = continuous(generate.text(stories, samplers.greedy()))
    spec = continuous(generate.text(stories, samplers.greedy(), speculate=speculate.draft(other)))
    a, b = plain(PROMPT, max_tokens=30), spec(PROMPT, max_tokens=30)
    _same(a, b)
    stats = b._last.speculation
    assert stats["forwards"] + stats["accepted"] == 29


def test_multinomial_keeps_the_distribution_and_json_stays_valid(stories, twin):
    """A greedy draft is a point mass: the rejection rule is "keep while the sampled token equals it", so one row
    with the same seed draws the same tokens as without speculation."""
    sampler = samplers.multinomial(temperature=0.8)
    plain = continuous(generate.text(stories, sampler))
    spec = continuous(generate.text(stories, sampler, speculate=speculate.draft(twin)))
    for seed in range(2):
        _same(plain(PROMPT, max_tokens=40, rng=torch.Generator().manual_seed(seed)),
              spec(PROMPT, max_tokens=40, rng=torch.Generator().manual_seed(seed)))
    gen = continuous(generate.json(stories, SCHEMA, samplers.multinomial(2), speculate=speculate.draft(twin)))
    validated = 0
    for seed in range(4):  # (a row may stop at max_tokens, and .value raises for it: every complete row must validate)
        out = gen(PROMPT, max_tokens=50, rng=torch.Generator().manual_seed(seed))
        last = out._last
        for text, start, end, complete in zip(out.texts, last.starts, last.ends, last.complete):
            if complete:
                jsonschema.validate(json.loads(text[start:end]), SCHEMA)
                validated += 1
    assert validated >= 2


def test_a_continued_state_drafts_without_prefilling_again(stories, twin):
    """The draft model's KV is kept by token prefix: the next call on the state computes only its new tokens."""
    spec = continuous(generate.text(stories, samplers.greedy(), speculate=speculate.draft(twin)))
    plain = continuous(generate.text(stories, samplers.greedy()))
    first = spec(PROMPT, max_tokens=20)
    before = twin.tokens_computed
    added = first + " Then"
    second = spec(added, max_tokens=12)
    new_tokens = len(added._ids[0]) - len(first._ids[0])
    # the draft model computes the added text, the tokens it drafts, and at most the first call's last token
    assert twin.tokens_computed - before <= new_tokens + 1 + 12
    _same(second, plain(plain(PROMPT, max_tokens=20) + " Then", max_tokens=12))


def test_run_batch_equals_each_call_alone(stories, twin):
    spec = continuous(generate.text(stories, samplers.greedy(), speculate=speculate.draft(twin)))
    prompts = [PROMPT, "One day, a cat", "The sun was"]
    together = run_batch(lambda p: spec(p, max_tokens=16), prompts)
    listed = spec(prompts, max_tokens=16)
    for i, p in enumerate(prompts):
        alone = spec(p, max_tokens=16)
        _same(together[i], alone)
        assert list(listed)[i] == str(alone)


def test_a_draft_model_of_another_vocabulary_or_with_beams_is_refused(stories, twin, gpt2_model):
    with pytest.raises(GeneratorArgumentError, match="same vocabulary"):
        generate.text(stories, samplers.greedy(), speculate=speculate.draft(gpt2_model))
    with pytest.raises(GeneratorArgumentError, match="beam search"):
        generate.text(stories, samplers.beam_search(2), speculate=speculate.draft(twin))
    with pytest.raises(GeneratorArgumentError, match="continuum model"):
        speculate.draft("a small model")
    with pytest.raises(GeneratorArgumentError, match="max_draft"):
        speculate.draft(twin, max_draft=0)


def test_on_llama_cpp_a_draft_gguf_with_the_targets_weights_has_every_draft_kept():
    """Both backends take any backend's draft model: the stories260K GGUF drafting for itself (a second load)."""
    pytest.importorskip("llama_cpp")
    path = str(fixture_path("models", "stories260K-gguf", "stories260K-f32.gguf"))
    # (the batch-invariant mode: a token's logits do not depend on how it was batched, so the draft's one-token
    # steps equal the target's verify block)
    target, draft = (models.llamacpp(path, n_threads=1, batch_invariant=True) for _ in range(2))
    plain = continuous(generate.text(target, samplers.greedy()))
    spec = continuous(generate.text(target, samplers.greedy(), speculate=speculate.draft(draft, max_draft=4)))
    a, b = plain(PROMPT, max_tokens=31), spec(PROMPT, max_tokens=31)
    assert list(a) == list(b)
    stats = b._last.speculation
    assert stats["accepted"] == stats["drafted"] > 0 and stats["forwards"] + stats["accepted"] == 30
    again = spec(b + " Then", max_tokens=9)  # (the draft's sequences are reused by prefix: still every draft kept)
    assert list(again) == list(plain(a + " Then", max_tokens=9))


def test_a_list_call_of_more_rows_than_keep_does_not_prefill_every_step(stories, twin):
    """Before: a list call of more rows than the draft table's ``keep`` dropped each row's draft KV before its next
    step, so the draft model prefilled every row's whole history at every step. Now the table holds one KV per row of
    the call: the draft model computes about what it drafts plus each prompt once."""
    prompts = [f"Once upon a time, a {w} named {n}" for w in ("cat", "dog", "bird") for n in ("Tom", "Sue", "Max")]
    spec = continuous(generate.text(stories, samplers.greedy(), speculate=speculate.draft(twin, keep=2)))
    before = twin.tokens_computed
    state = spec(prompts, max_tokens=24)
    computed = twin.tokens_computed - before
    prompt_tokens = int(state._mask[:, :-24].sum())
    assert computed <= prompt_tokens + len(prompts) * 24  # (each prompt once, then about one position per token)
    plain = continuous(generate.text(stories, samplers.greedy()))(prompts, max_tokens=24)
    assert list(state) == list(plain)
