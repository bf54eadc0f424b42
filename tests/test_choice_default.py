"""Issue 56's choice "bug", as a regression test: a choice made without a sampler is the best option.

What was found: ``generate.choice(model, options)`` with no sampler drew the option at random
(``multinomial()``, every generator's default then, on torch's unseeded global generator). An option
the model gives 6% was taken 1-2 times in 48 calls, a different call each run, and the same state
picked twice could get two answers: it looked like a result that depends on what ran before. The
scoring itself was right (explicit greedy choices matched both references every time). A choice is
a decision, so its default is now greedy, like guidance's ``select`` and SGLang's ``select``.

Reference: the backend's own evaluation of ``state + option`` (transformers' forward; llama-cpp-python's
``Llama.eval`` on the f32 GGUF), compared wherever the two options' margin exceeds the noise.
"""

from __future__ import annotations

import pytest
import torch

from continuum import continuous, generate, models, samplers

from conftest import fixture_path

OPTIONS = [" yes", " no"]
ITEMS, ROUNDS = 12, 3  # the repro: 12 text -> choice calls, 3 rounds, in one process


def _ids(state) -> list[int]:
    return [i for i, m in zip(state._ids[0].tolist(), state._mask[0].tolist()) if m]


def _option_score(logprobs_of, state, option: str) -> float:
    """Total log-prob of ``option`` after ``state``, tokenized as ``state + option`` (the reference's ids)."""
    base, full = _ids(state), _ids(state + option)
    assert full[:len(base)] == base
    lp = logprobs_of(full)
    return sum(float(lp[c - 1][full[c]]) for c in range(len(base), len(full)))


def _run_repro(model, logprobs_of, tol: float) -> int:
    text = continuous(generate.text(model, samplers.greedy()))
    pick = continuous(generate.choice(model, OPTIONS))  # no sampler: the default under test
    checked = 0
    for _ in range(ROUNDS):
        for x in range(ITEMS):
            s = text(f"item {x}: once upon a time", max_tokens=6) + " ok?"
            first, second = pick(s), pick(s)
            assert first.value == second.value, f"item {x}: the same state picked twice gave two answers"
            scores = [_option_score(logprobs_of, s, o) for o in OPTIONS]
            if abs(scores[0] - scores[1]) > tol:
                best = OPTIONS[max(range(len(OPTIONS)), key=scores.__getitem__)]
                assert first.value == best, f"item {x}: picked {first.value!r}, reference scores {scores}"
                checked += 1
    assert checked >= ITEMS * ROUNDS // 2, "the comparison must not be vacuous"
    return checked


def test_default_choice_is_the_best_option_on_transformers():
    model = models.transformers(str(fixture_path("models", "stories260K")))

    @torch.no_grad()
    def logprobs_of(ids):
        return torch.log_softmax(model.model(input_ids=torch.tensor([ids])).logits[0].float(), -1).tolist()

    _run_repro(model, logprobs_of, tol=1e-3)  # fp32: summation order only


def test_default_choice_is_the_best_option_on_llamacpp():
    pytest.importorskip("llama_cpp")
    import numpy as np

    from llamacpp_support import CROSS_TOL, gguf, reference_logits

    model = models.llamacpp(str(gguf("f32")), n_threads=2)

    def logprobs_of(ids):
        logits = reference_logits("f32", ids)
        return (logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)).tolist()

    _run_repro(model, logprobs_of, tol=10 * CROSS_TOL)  # llama.cpp's logits depend on the batch's composition


def test_an_explicit_sampler_still_draws(stories):
    """multinomial(n) is still n draws from the options' distribution (seeded: reproducible)."""
    gen = generate.choice(stories, OPTIONS, samplers.multinomial(64))
    a = gen("Once upon a time", rng=torch.Generator().manual_seed(0))
    b = gen("Once upon a time", rng=torch.Generator().manual_seed(0))
    assert a == b and len(a) == 64 and set(a) <= set(OPTIONS)
