"""``models.llamacpp``: every generator on a GGUF through the backend protocol, against llama-cpp-python's own
evaluation of the same ids (``Llama(logits_all=True).eval``). Tolerances: tests/llamacpp_support.py.

Greedy tokens are compared with the reference's argmax wherever its top-2 margin exceeds the stated tolerance
(decode-by-token and prefill differ by up to it); merged calls equal each alone exactly in the batch-invariant mode.
"""

from __future__ import annotations

import pytest
import torch

from continuum import continuous, generate, models, run_batch, samplers
from continuum.errors import ContinuumError
from continuum.models import kv
from continuum.models.protocol import Backend

from llamacpp_support import CROSS_TOL, assert_agree_up_to_a_tie, fp32_model, gguf, reference_logprobs, row_ids
from llamacpp_support import check_greedy_path as _check_greedy_path


@pytest.fixture(scope="module")
def model():
    return models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=2)


def _ids(state) -> list[int]:
    """Row 0's token ids (its padding dropped)."""
    return state.token_ids[0][state.attention_masks[0].bool()].tolist()


def test_implements_the_backend_protocol_and_greedy_follows_llama_cpp(model):
    assert isinstance(model, Backend)
    s = continuous(generate.text(model, samplers.greedy()))("Once upon a time", max_tokens=30)
    assert kv.opaque(s._kv) and kv.length(s._kv) > 0
    prompt = len(model.tokenizer.encode_prompts(["Once upon a time"])[0])
    _check_greedy_path(_ids(s), prompt)


def test_continue_and_slice_compute_only_new_tokens_and_follow_llama_cpp(model):
    gen = continuous(generate.text(model, samplers.greedy()))
    s1 = gen("Once upon a time", max_tokens=20)
    before = model.tokens_computed
    s2 = gen(s1 + " One day,", max_tokens=12)
    added = len(_ids(s2)) - len(_ids(s1))
    assert model.tokens_computed - before <= added + 1  # the appended text and the new tokens, nothing before
    _check_greedy_path(_ids(s2), len(_ids(s1 + " One day,")))
    cut = s2[:len("Once upon a time, there was")]
    before = model.tokens_computed
    s3 = gen(cut + " a dog", max_tokens=10)
    assert model.tokens_computed - before <= len(_ids(s3)) - len(_ids(cut)) + 1
    assert str(s3).startswith("Once upon a time, there was a dog")
    _check_greedy_path(_ids(s3), len(_ids(cut + " a dog")))
    assert str(s1) + " One day," == str(s2)[:len(str(s1)) + 9]  # s1 unchanged by what continued it


def test_constrained_generators_and_samplers(model):
    base = continuous(generate.text(model, samplers.greedy()))("Once upon a time", max_tokens=10)
    mood = continuous(generate.regex(model, r" (happy|sad|big)", samplers.greedy()))(base + " She was very", max_tokens=16)
    assert mood.value in (" happy", " sad", " big")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    card = continuous(generate.json(model, schema, samplers.greedy()))(base + " As JSON: ", max_tokens=30)
    assert set(card.value) == {"name"} and len(card.value["name"]) <= 8
    beams = continuous(generate.text(model, samplers.beam_search(3)))("Once upon a time", max_tokens=6)
    w = beams.weights[0].tolist()
    assert len(list(beams)) == 3 and w == sorted(w, reverse=True)
    draws = generate.text(model, samplers.multinomial(4))("Once upon a time", max_tokens=6,
                                                          rng=torch.Generator().manual_seed(0))
    assert len(draws) == 4
    assert generate.choice(model, [" yes", " no"], method="greedy")("Is it?") in (" yes", " no")


def test_run_batch_equals_each_alone_exactly(model):
    gen = generate.text(model, samplers.greedy())
    prompts = ["Once", "One day", "The cat", "Lily and Tom", "The sun"]
    alone = [gen(p, max_tokens=12) for p in prompts]
    assert run_batch(lambda p: gen(p, max_tokens=12), prompts) == alone


def test_a_state_from_the_transformers_backend_is_recomputed_not_reused(model, llama_model):
    s = continuous(generate.text(llama_model, samplers.greedy()))("Hello", max_tokens=3)
    with pytest.raises(ContinuumError):
        continuous(generate.text(model, samplers.greedy()))(s, max_tokens=3)  # another tokenizer: refused clearly


def test_save_load_keeps_tokens_and_the_cache(model, tmp_path):  # (more: tests/test_llamacpp_persistence.py)
    gen = continuous(generate.text(model, samplers.greedy()))
    s = gen("Once upon a time", max_tokens=10)
    s.save(tmp_path / "s.safetensors")
    back = type(s).load(tmp_path / "s.safetensors", model)
    assert str(back) == str(s) and torch.equal(back.weights, s.weights) and kv.length(back._kv) == kv.length(s._kv)
    assert str(gen(back, max_tokens=8)) == str(gen(s, max_tokens=8))  # the sequence's bytes restored: same result


def test_forks_never_change_the_state_they_came_from(model):
    gen = continuous(generate.text(model, samplers.greedy()))
    s = gen("Once upon a time", max_tokens=8)
    text, weights = str(s), s.weights.clone()
    first = str(gen(s + " The dog", max_tokens=6))
    beams = continuous(generate.text(model, samplers.beam_search(3)))(s + " The cat", max_tokens=6)
    assert len(list(beams)) == 3
    assert str(s) == text and torch.equal(s.weights, weights)
    assert str(gen(s + " The dog", max_tokens=6)) == first  # s's sequence was not extended in place by its forks


def test_the_same_weights_give_the_same_text_on_both_backends(stories):
    """stories260K as safetensors (transformers, fp32) and as an f32 GGUF (llama.cpp with an f32 KV cache, no flash
    attention): greedy text, classifier-free guidance (both modes) and token healing agree up to the first near-tie
    within ``CROSS_TOL`` (``llamacpp_support``), the transformers backend serving as an independent reference; for
    guidance the tie is read on ``uncond + s * (cond - uncond)`` of transformers' own log-probs, whose error is at
    most ``(1 + 2s)`` times theirs."""
    fp32 = fp32_model()
    for kwargs, prompt in [({}, "Once upon a time"), ({"token_healing": True}, "Once upon a ti"),
                           ({"guidance_scale": 2.0, "negative_prompt": "She was sad"}, "Lily opened the door. She"),
                           ({"guidance_scale": 2.0, "negative_prompt": "She was sad", "cfg_mode": "sequential"},
                            "Lily opened the door. She")]:
        ours, ref = (continuous(generate.text(mm, samplers.greedy(), **kwargs))(prompt, max_tokens=16) for mm in (fp32, stories))
        a, b = row_ids(ours), row_ids(ref)
        tol, score = CROSS_TOL, None
        if "guidance_scale" in kwargs:
            s, n = kwargs["guidance_scale"], len(stories.tokenizer.encode_prompts([prompt])[0])
            neg = stories.tokenizer.encode_prompts([kwargs["negative_prompt"]])[0]

            def score(prefix, s=s, n=n, neg=neg):
                cond, uncond = reference_logprobs(stories, prefix), reference_logprobs(stories, neg + prefix[n:])
                return uncond + s * (cond - uncond)

            tol = CROSS_TOL * (1 + 2 * s)
        assert_agree_up_to_a_tie(a, b, stories, tol, score)
        if a == b:
            assert str(ours) == str(ref)
