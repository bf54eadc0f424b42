"""Classifier-free guidance: checked against the formula computed from plain HF forwards.

The independent reference is the HF model called directly on unpadded, uncached sequences:
``cond`` = log-softmax after prompt + generated tokens, ``uncond`` = after the negative prompt (or
BOS) + the same generated tokens; guided = ``uncond + s * (cond - uncond)``, blended with ``r``.
"""

from __future__ import annotations

import json as jsonlib
import math
import re

import jsonschema
import pytest
import torch

from continuum import BatchMismatch, continuous, generate, models, samplers
from continuum.errors import ContextLengthError, GeneratorArgumentError

from conftest import assert_reuse_exact, make_bpe_tokenizer, tiny_gpt2

PROMPTS = ["Once upon a time", "The quick brown fox jumps"]
NEGATIVE = "Le café est très bon à Paris; naïve façade"


@torch.no_grad()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """``(len(ids), vocab)``: row i = next-token log-probs after ``ids[:i + 1]`` (one plain HF forward,
    no padding, no cache)."""
    out = model.model(input_ids=torch.tensor([ids]))
    return torch.log_softmax(out.logits[0].float(), -1)


def by_hand(cond: torch.Tensor, uncond: torch.Tensor, scale: float, rescale: float) -> torch.Tensor:
    guided = uncond + scale * (cond - uncond)
    return rescale * cond + (1 - rescale) * guided


def real_ids(state, row: int) -> list[int]:
    ids, mask = state.token_ids[row], state.attention_masks[row]
    return ids[mask.bool()].tolist()


def prompt_ids(model, text: str) -> list[int]:
    return model.tokenizer.encode_prompts([text])[0]


def uncond_prefix(model, prompt: list[int], negative) -> list[int]:
    if negative is not None:
        return prompt_ids(model, negative)
    bos = model.tokenizer.bos_token_id
    return [bos] if bos is not None else prompt[-1:]


def check_by_hand(model, state, row: int, prompt: list[int], negative, scale: float, rescale: float) -> None:
    """Every generated token of a greedy row is the argmax of the guided scores; its log-prob is the raw one."""
    ids = real_ids(state, row)
    assert ids[:len(prompt)] == prompt
    gen, lps = ids[len(prompt):], state.token_logprobs[row][state.attention_masks[row].bool()][len(prompt):]
    assert gen, "nothing generated"
    prefix = uncond_prefix(model, prompt, negative)
    cond_all, uncond_all = hf_logprobs(model, prompt + gen), hf_logprobs(model, prefix + gen)
    for t, token in enumerate(gen):
        cond = cond_all[len(prompt) + t - 1]
        guided = by_hand(cond, uncond_all[len(prefix) + t - 1], scale, rescale)
        assert guided[token] >= guided.max() - 1e-4, (t, token, int(guided.argmax()))
        assert abs(float(lps[t]) - float(cond[token])) < 1e-4
    assert abs(float(state.weights.flatten()[row]) - float(lps.sum())) < 1e-4


def test_guided_logprobs_is_the_formula():
    from continuum.loop.cfg import guided_logprobs, guided_scores

    cond, uncond = torch.randn(3, 7).log_softmax(-1), torch.randn(3, 7).log_softmax(-1)
    torch.testing.assert_close(guided_logprobs(cond, uncond, 2.5, 0.3), by_hand(cond, uncond, 2.5, 0.3))
    torch.testing.assert_close(guided_scores(cond * 4, uncond * 4, 2.0),
                               by_hand((cond * 4).log_softmax(-1), (uncond * 4).log_softmax(-1), 2.0, 0.0))
    cond[0, 1] = -math.inf  # a token the conditional branch excludes stays excluded
    assert guided_logprobs(cond, uncond, -1.0)[0, 1] == -math.inf


def test_scale_one_is_unguided_and_runs_nothing_extra(model):
    plain = continuous(generate.text(model, samplers.greedy()))
    one = continuous(generate.text(model, samplers.greedy(), guidance_scale=1.0, negative_prompt=NEGATIVE))
    assert one.generator.guidance is None
    calls, tokens = model.forward_calls, model.tokens_computed
    a = plain(PROMPTS, max_tokens=6)
    calls_a, tokens_a = model.forward_calls - calls, model.tokens_computed - tokens
    b = one(PROMPTS, max_tokens=6)
    assert (model.forward_calls - calls - calls_a, model.tokens_computed - tokens - tokens_a) == (calls_a, tokens_a)
    assert a.texts == b.texts
    torch.testing.assert_close(a.weights, b.weights, atol=0, rtol=0)


@pytest.mark.parametrize("scale,rescale,mode", [(2.5, 0.0, "batched"), (4.0, 0.4, "sequential"), (-1.0, 0.0, "batched")])
def test_greedy_steps_match_the_formula_by_hand(model, scale, rescale, mode):
    gen = continuous(generate.text(model, samplers.greedy(), guidance_scale=scale, negative_prompt=NEGATIVE,
                                   guidance_rescale=rescale, cfg_mode=mode))
    state = gen(PROMPTS, max_tokens=5)
    for row, text in enumerate(PROMPTS):
        check_by_hand(model, state, row, prompt_ids(model, text), NEGATIVE, scale, rescale)


@pytest.mark.parametrize("has_bos", [True, False])
def test_default_unconditional_prompt_is_bos_or_the_last_token(has_bos):
    tok = make_bpe_tokenizer()
    if not has_bos:
        tok.bos_token = None
    hf = tiny_gpt2(len(tok), seed=3)
    hf.config.eos_token_id = hf.generation_config.eos_token_id = tok.eos_token_id
    model = models.Transformers(hf, tok)
    assert (model.tokenizer.bos_token_id is not None) == has_bos
    state = continuous(generate.text(model, samplers.greedy(), guidance_scale=3.0))(PROMPTS, max_tokens=4)
    for row, text in enumerate(PROMPTS):
        check_by_hand(model, state, row, prompt_ids(model, text), None, 3.0, 0.0)


def test_guidance_changes_a_greedy_output(gpt2_model):
    plain = generate.text(gpt2_model, samplers.greedy())(PROMPTS, max_tokens=8)
    guided = (generate.text(gpt2_model, samplers.greedy(), guidance_scale=s, negative_prompt=NEGATIVE)(PROMPTS, max_tokens=8)
              for s in (3.0, 6.0, 1.5))
    assert any(g != plain for g in guided)  # lazily: stops at the first scale that changes the output


def test_rescale_one_gives_the_conditional_distribution(model):
    plain = continuous(generate.text(model, samplers.greedy()))(PROMPTS, max_tokens=6)
    calls = model.forward_calls
    full = continuous(generate.text(model, samplers.greedy(), guidance_scale=5.0, negative_prompt=NEGATIVE,
                                    guidance_rescale=1.0, cfg_mode="sequential"))(PROMPTS, max_tokens=6)
    assert model.forward_calls - calls > 6  # the unconditional branch did run
    assert plain.texts == full.texts
    torch.testing.assert_close(plain.weights, full.weights, atol=1e-4, rtol=0)


@pytest.mark.parametrize("sampler", [samplers.greedy(), samplers.beam_search(3), samplers.multinomial(2, temperature=0.0)],
                         ids=["greedy", "beams", "multinomial-t0"])
def test_batched_equals_sequential(model, sampler):
    negatives = ["a", NEGATIVE + " " + NEGATIVE]  # one shorter and one longer than its prompt
    out = {}
    for mode in ("batched", "sequential"):
        gen = continuous(generate.text(model, sampler, guidance_scale=3.0, negative_prompt=negatives, cfg_mode=mode))
        out[mode] = gen(PROMPTS, max_tokens=7)
    assert out["batched"].texts == out["sequential"].texts
    torch.testing.assert_close(out["batched"].weights, out["sequential"].weights, atol=1e-4, rtol=0)
    for state in out.values():  # the result keeps only the conditional rows' cache, and reusing it is exact
        assert state._kv.tensors()[0][0].shape[0] == state.rows
        assert_reuse_exact(state)


def _check_weights_are_conditional_raw_logprobs(model, state, prompts):
    for row in range(state.rows):
        ids = real_ids(state, row)
        prompt = prompt_ids(model, prompts[row // state.samples])
        lps = hf_logprobs(model, ids)
        total = sum(float(lps[t - 1, ids[t]]) for t in range(len(prompt), len(ids)))
        assert abs(total - float(state.weights.flatten()[row])) < 1e-3, row


def test_beams_and_samples_weights_are_the_conditional_raw_logprobs(model):
    beams = continuous(generate.text(model, samplers.beam_search(3), guidance_scale=2.0, negative_prompt=["x", NEGATIVE]))(
        PROMPTS, max_tokens=5)
    assert (beams.batch, beams.samples) == (2, 3)
    assert all(len(set(beams.texts[b * 3:(b + 1) * 3])) == 3 for b in range(2))  # distinct beams
    _check_weights_are_conditional_raw_logprobs(model, beams, PROMPTS)
    draws = continuous(generate.text(model, samplers.multinomial(3), guidance_scale=2.0, cfg_mode="sequential"))(
        PROMPTS, max_tokens=5, rng=torch.Generator().manual_seed(0))
    assert (draws.batch, draws.samples) == (2, 3)
    _check_weights_are_conditional_raw_logprobs(model, draws, PROMPTS)


def test_constraints_hold_under_guidance(model):
    kw = dict(guidance_scale=4.0, negative_prompt=NEGATIVE)
    for sampler in (samplers.greedy(), samplers.beam_search(2)):
        out = generate.regex(model, r"[0-9]{3}-[a-z]{2}", sampler, **kw)(PROMPTS, max_tokens=12)
        flat = [x for o in out for x in (o if isinstance(o, list) else [o])]
        assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", x) for x in flat), flat
    options = [" yes", " no", " maybe so"]
    assert all(o in options for o in generate.choice(model, options, samplers.greedy(), method="greedy", **kw)(PROMPTS))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "c": {"enum": ["red", "green", "blue"]}},
              "required": ["ok", "c"], "additionalProperties": False}
    for value in generate.json(model, jsonlib.dumps(schema), samplers.greedy(), **kw)(PROMPTS, max_tokens=40):
        jsonschema.validate(value, schema)


@pytest.mark.parametrize("method", ["exact", "mean"])
def test_choice_scoring_ranks_by_guided_option_scores(model, method):
    options, scale = [" yes", " no", " maybe so", " x"], 3.0
    gen = continuous(generate.choice(model, options, samplers.greedy(), method=method, guidance_scale=scale,
                                     negative_prompt=NEGATIVE))
    state = gen(PROMPTS)
    for row, text in enumerate(PROMPTS):
        prompt, neg = prompt_ids(model, text), prompt_ids(model, NEGATIVE)
        scores, raw = [], []
        for option in options:
            opt = model.tokenizer.encode_continuation(option)
            c_all, u_all = hf_logprobs(model, prompt + opt), hf_logprobs(model, neg + opt)
            cond = [float(c_all[len(prompt) + j - 1, opt[j]]) for j in range(len(opt))]
            unc = [float(u_all[len(neg) + j - 1, opt[j]]) for j in range(len(opt))]
            guided = sum(u + scale * (c - u) for c, u in zip(cond, unc))
            scores.append(guided / len(opt) if method == "mean" else guided)
            raw.append(sum(cond))
        best = max(range(len(options)), key=scores.__getitem__)
        assert state.value[row] == options[best]
        assert abs(float(state.weights.flatten()[row]) - raw[best]) < 1e-4  # weights: raw log-probs


def test_streaming_under_guidance(model):
    gen = generate.text(model, samplers.greedy(), guidance_scale=3.0, negative_prompt=NEGATIVE)
    stream = gen.stream(PROMPTS[0], max_tokens=8)
    chunks = list(stream)
    assert "".join(chunks) == stream.result == gen(PROMPTS[0], max_tokens=8)


@pytest.mark.parametrize("mode", ["batched", "sequential"])
def test_continuous_chaining_rebuilds_the_branch_per_call(model, mode):
    gen = continuous(generate.text(model, samplers.greedy(), guidance_scale=2.5, negative_prompt=NEGATIVE, cfg_mode=mode))
    s1 = gen(PROMPTS[0], max_tokens=4)
    s2 = gen(s1 + " and then", max_tokens=4)
    # call 2: the conditional branch sees everything; the unconditional one the negative prompt + call 2's tokens
    before = real_ids(s2, 0)[:len(real_ids(s1, 0)) + len(model.tokenizer.encode_continuation(" and then"))]
    check = s2[0, 0, :len(s2.texts[0])]  # same state, used to read call 2's tokens
    ids = real_ids(check, 0)
    gen2, neg = ids[len(before):], prompt_ids(model, NEGATIVE)
    lps = s2.token_logprobs[0][s2.attention_masks[0].bool()]
    cond_all, uncond_all = hf_logprobs(model, before + gen2), hf_logprobs(model, neg + gen2)
    for t, token in enumerate(gen2):
        cond = cond_all[len(before) + t - 1]
        guided = by_hand(cond, uncond_all[len(neg) + t - 1], 2.5, 0.0)
        assert guided[token] >= guided.max() - 1e-4
        assert abs(float(lps[len(before) + t]) - float(cond[token])) < 1e-4
    assert abs(float(s2.weights.flatten()[0]) - float(s1.weights.flatten()[0]) - float(lps[len(before):].sum())) < 1e-4
    assert_reuse_exact(s2)


def test_negative_prompt_list_must_match_the_batch(model):
    gen = generate.text(model, samplers.greedy(), guidance_scale=2.0, negative_prompt=["a", "b", "c"])
    with pytest.raises(BatchMismatch, match="3 negative prompts for 2 prompts"):
        gen(PROMPTS, max_tokens=3)
    assert len(gen(PROMPTS + ["third"], max_tokens=3)) == 3  # the generator stays usable


@pytest.mark.parametrize("kwargs,match", [
    (dict(guidance_scale=float("nan")), "guidance_scale must be a finite number"),
    (dict(guidance_scale="2"), "guidance_scale must be a finite number"),
    (dict(guidance_scale=True), "guidance_scale must be a finite number"),
    (dict(guidance_scale=2.0, guidance_rescale=1.5), r"guidance_rescale must be in \[0, 1\]"),
    (dict(guidance_scale=2.0, cfg_mode="parallel"), "cfg_mode must be 'batched'"),
    (dict(guidance_scale=2.0, negative_prompt=[]), "negative_prompt must be a string or a non-empty list"),
    (dict(guidance_scale=2.0, negative_prompt=[1, 2]), "negative_prompt must be a string or a non-empty list"),
    (dict(guidance_scale=2.0, negative_prompt=""), "tokenize to no token"),
])
def test_arguments_are_checked_at_creation(gpt2_model, kwargs, match):
    for make in (lambda: generate.text(gpt2_model, **kwargs), lambda: generate.regex(gpt2_model, "[a-z]+", **kwargs),
                 lambda: generate.choice(gpt2_model, ["a", "b"], **kwargs),
                 lambda: generate.json(gpt2_model, {"type": "integer"}, **kwargs)):
        with pytest.raises(GeneratorArgumentError, match=match):
            make()


def test_a_negative_prompt_longer_than_the_context_is_refused(gpt2_model):
    long = " ".join(["word"] * 400)
    gen = generate.text(gpt2_model, samplers.greedy(), guidance_scale=2.0, negative_prompt=long)
    with pytest.raises(ContextLengthError, match="negative prompt"):
        gen("hi", max_tokens=3)


@pytest.mark.parametrize("mode", ["sequential", "batched"])
def test_max_tokens_none_on_a_huge_context_allocates_a_small_unconditional_mask(spm_tokenizer, monkeypatch, mode):
    """Guidance on a context of 2**20 positions with max_tokens=None: the unconditional branch's mask starts at its
    prompt plus a few hundred columns, not the context, grows as the call goes past them, and the text equals the
    same call with max_tokens set."""
    from continuum.loop import setup
    from continuum.loop.cfg import UnconditionalBranch

    from conftest import tiny_llama

    model = models.Transformers(tiny_llama(len(spm_tokenizer), max_positions=2**20), spm_tokenizer)
    made = []

    class Spy(UnconditionalBranch):  # (records the mask's width; the behaviour is the branch's)
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append((self.width, self.mask.shape[1]))

    monkeypatch.setattr(setup, "UnconditionalBranch", Spy)
    gen = generate.text(model, samplers.greedy(), guidance_scale=3.0, negative_prompt=NEGATIVE, cfg_mode=mode)
    text = gen("Once upon a time", max_tokens=300)
    assert len(model.tokenizer.encode_continuation(text)) > 260  # past the columns allocated up front
    stop = next(text[-k:] for k in range(1, len(text) + 1) if text.find(text[-k:]) == len(text) - k)  # ends it there
    made.clear()
    assert gen("Once upon a time", max_tokens=None, stop_at=stop) == text
    assert made and all(cols - width <= 256 for width, cols in made)
