"""Forced-token fast-forward: same values as step-by-step decoding, fewer forwards, exact weights and caches."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import BaseModel, Field

from continuum import continuous, generate, samplers
from continuum.loop.fastforward import forced_runs

from conftest import assert_reuse_exact

PROMPTS = ["Answer: ", "The user is", "x"]
OPTIONS = ["Positive feedback", "Negative feedback", "Neutral", "No opinion at all"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "size": {"enum": ["small", "large"]},
                                           "ok": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 2}},
          "required": ["name", "size", "ok", "tags"], "additionalProperties": False}


class Item(BaseModel):
    label: str = Field(max_length=5)
    flag: bool


def make(model, case: str, sampler, fast_forward: bool):
    if case == "regex":
        return generate.regex(model, r"(id-[0-9]{2}: (red|green|blue)_value)|(none, really)", sampler,
                              fast_forward=fast_forward)
    if case in ("json", "json-outlines"):  # llguidance (its compute_ff_tokens), and outlines-core
        backend = "outlines" if case == "json-outlines" else "llguidance"
        return generate.json(model, SCHEMA, sampler, whitespace_pattern="", fast_forward=fast_forward, backend=backend)
    if case == "pydantic":
        return generate.json(model, Item, sampler, whitespace_pattern="", fast_forward=fast_forward)
    return generate.choice(model, OPTIONS, sampler, method="greedy", fast_forward=fast_forward)


def run(model, case, sampler, fast_forward, prompts=PROMPTS, max_tokens=60):
    before = model.forward_calls
    state = continuous(make(model, case, sampler, fast_forward))(prompts, max_tokens=max_tokens)
    return state, model.forward_calls - before


def normal(value):
    return value.model_dump() if isinstance(value, BaseModel) else value


@pytest.mark.parametrize("case", ["regex", "json", "json-outlines", "pydantic", "choice"])
@pytest.mark.parametrize("sampler", [samplers.greedy(), samplers.beam_search(3)], ids=["greedy", "beam"])
def test_same_values_as_step_by_step(model, case, sampler):
    fast, fast_calls = run(model, case, sampler, True)
    slow, slow_calls = run(model, case, sampler, False)
    assert all(fast._last.complete) and all(slow._last.complete)
    assert [normal(v) for v in _flat(fast.value)] == [normal(v) for v in _flat(slow.value)]
    assert list(fast) == list(slow)
    torch.testing.assert_close(fast.weights, slow.weights, atol=1e-4, rtol=0)
    assert fast_calls <= slow_calls
    if model.tokenizer.is_byte_level:  # byte-fallback vocabularies allow a byte token beside most
        assert fast_calls < slow_calls  # tokens, so outlines-core rarely has exactly one allowed


def _flat(value):
    out = []
    for v in value if isinstance(value, list) else [value]:
        out.extend(_flat(v) if isinstance(v, list) else [v])
    return out


def prompt_lengths(model, prompts, samples):
    return [len(ids) for ids in model.tokenizer.encode_prompts(prompts) for _ in range(samples)]


def hf_logprobs(state) -> torch.Tensor:
    ids, mask = state.token_ids, state.attention_masks
    with torch.no_grad():
        out = state.model.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    return torch.log_softmax(out.logits.float(), -1)


@pytest.mark.parametrize("case", ["regex", "json", "choice"])
@pytest.mark.parametrize("sampler", [samplers.greedy(), samplers.beam_search(2), samplers.multinomial(2)],
                         ids=["greedy", "beam", "multinomial"])
def test_weights_are_the_logprobs_of_a_plain_forward(model, case, sampler):
    """Every output token (forced ones included) is in the token log-probs and the weights."""
    state, _ = run(model, case, sampler, True)
    lp = hf_logprobs(state)
    ids, mask = state.token_ids, state.attention_masks
    tlp = state.token_logprobs
    for r, start in enumerate(prompt_lengths(model, PROMPTS, sampler.samples)):
        cols = mask[r].nonzero().flatten()[start:]  # the generated tokens: everything after the prompt
        expected = lp[r, cols - 1, ids[r, cols]]
        torch.testing.assert_close(tlp[r, cols], expected, atol=1e-4, rtol=0)
        assert math.isclose(float(state.weights.flatten()[r]), float(expected.sum()), abs_tol=1e-4)


def test_forced_runs_per_row_budget_and_beams(gpt2_model):
    """Runs are per row, cut at each row's budget; beams of one item share the shortest run."""
    guide = make(gpt2_model, "choice", samplers.greedy(), True).guide
    tok = gpt2_model.tokenizer
    states, texts = [], []
    for option in ["Positive feedback", "No opinion at all"]:
        ids, s = tok.encode_continuation(option), guide.new_state()
        for i, t in enumerate(ids):  # noqa: B007 - i is read below; walk to the first state that forces the rest of the option
            s = guide.advance(s, t)
            if guide.forced_tokens(s):
                break
        states.append(s)
        texts.append(tok.decode(ids[:i + 1]))
    runs = forced_runs(guide, states, [True, True], [100, 100], 1, False)
    for t, r, option in zip(texts, runs, ["Positive feedback", "No opinion at all"]):
        assert r and option.startswith(t + tok.decode(r))  # exactly one allowed token at each: a prefix
    if len(runs[0]) == len(runs[1]):
        pytest.skip("this fixture tokenizer forces runs of equal lengths")
    short = min(map(len, runs))
    assert forced_runs(guide, states, [True, True], [100, 1], 1, False) == [runs[0], runs[1][:1]]
    assert forced_runs(guide, states, [True, True], [100, 100], 2, True) == [r[:short] for r in runs]
    assert forced_runs(guide, states, [True, False], [100, 100], 2, True) == [runs[0], []]


def test_fewer_forwards_and_exact_cache(gpt2_model):
    model = gpt2_model
    fast, fast_calls = run(model, "json", samplers.greedy(), True)
    slow, slow_calls = run(model, "json", samplers.greedy(), False)
    assert fast_calls * 1.5 <= slow_calls  # compact JSON: keys and punctuation are forced
    assert_reuse_exact(fast)
    assert fast.cached_tokens.tolist() == slow.cached_tokens.tolist()


def test_real_tokenizers(real_tokenizer_model):
    model = real_tokenizer_model
    for sampler in (samplers.greedy(), samplers.beam_search(2)):
        fast, fast_calls = run(model, "choice", sampler, True, prompts=["Review: ok", "x"])
        slow, slow_calls = run(model, "choice", sampler, False, prompts=["Review: ok", "x"])
        assert fast.value == slow.value and list(fast) == list(slow)
        torch.testing.assert_close(fast.weights, slow.weights, atol=1e-4, rtol=0)
        assert fast_calls <= slow_calls
        assert_reuse_exact(fast)


def test_max_tokens_counts_forced_tokens(model):
    gen = continuous(generate.choice(model, ["Positive feedback is long"], samplers.greedy(), method="greedy"))
    for budget in range(1, 6):
        state = gen(["x", "Answer: "], max_tokens=budget)
        generated = (state.token_logprobs == state.token_logprobs).sum(1)  # not NaN
        assert int(generated.max()) == budget
        assert not any(state._last.complete)
        assert_reuse_exact(state)


def test_stop_at_inside_a_forced_run(model):
    for ff in (True, False):
        gen = generate.choice(model, ["alpha beta gamma delta"], samplers.greedy(), method="greedy", fast_forward=ff)
        state = continuous(gen)(["x", "Answer: "], stop_at="gamma")
        assert state.last_text == ["alpha beta gamma"] * 2
        assert_reuse_exact(state)


def test_fast_forwarded_state_continues_correctly(model):
    """Text after a fast-forwarded state equals HF greedy decoding from its tokens, and a constrained
    step cut inside a forced run resumes to the same value as an uncut one."""
    state, _ = run(model, "json", samplers.greedy(), True)
    more = continuous(generate.text(model, samplers.greedy()))(state, max_tokens=5)
    assert_reuse_exact(more)
    ids, mask = state.token_ids, state.attention_masks
    with torch.no_grad():
        ref = model.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                   pad_token_id=model.tokenizer.pad_token_id, eos_token_id=model.tokenizer.eos_token_id)
    assert list(more) == model.tokenizer.decode_batch(ref.tolist())
    json_c = continuous(make(model, "json", samplers.greedy(), True))
    for cut in (3, 7):
        resumed = json_c(json_c(PROMPTS, max_tokens=cut), max_tokens=60)
        assert [normal(v) for v in resumed.value] == [normal(v) for v in state.value]
        assert_reuse_exact(resumed)


def test_streaming_with_fast_forward(model):
    gen = make(model, "json", samplers.greedy(), True)
    stream = gen.stream("Answer: ", max_tokens=60)
    chunks = list(stream)
    assert json.loads("".join(chunks)) == stream.result


def test_fast_forward_argument_is_checked(model):
    from continuum.errors import GeneratorArgumentError

    with pytest.raises(GeneratorArgumentError, match="fast_forward"):
        generate.regex(model, "a+", fast_forward="yes")
