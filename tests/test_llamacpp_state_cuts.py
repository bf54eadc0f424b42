"""Cutting and stacking llama.cpp batch states: rows cut at different places keep only their kept tokens' cells
(a llama.cpp view attends to every cell it covers, not to the mask), and stacked states continue like each alone.

References: a fresh state built from the same token ids with no cache (one prefill), and llama-cpp-python's own
evaluation of those ids (``reference_logits``; tolerances: tests/llamacpp_support.py).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from continuum import SequenceState, continuous, generate, models, samplers
from continuum.errors import BackendError
from continuum.models import kv

from llamacpp_support import DECODE_TOL, gguf, reference_logits

PROMPTS = ["Once upon a time", "Lily and Tom went to the park"]


@pytest.fixture(scope="module")
def model():
    return models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=2)


@pytest.fixture(scope="module")
def gen(model):
    return continuous(generate.text(model, samplers.greedy()))


@pytest.fixture(scope="module")
def base(gen):
    return gen(PROMPTS, max_tokens=12)


def _rows(state) -> list[list[int]]:
    return [ids[m.bool()].tolist() for ids, m in zip(state.token_ids, state.attention_masks)]


def _fresh(model, ids: list[int]) -> SequenceState:
    """A state of ``ids`` with no cache (the next forward computes them all in one prefill)."""
    return SequenceState._from_rows(model, [ids], [[float("nan")] * len(ids)], torch.zeros(1), 1, 1, None)


def _check_like_fresh(model, gen, cut: SequenceState, n: int = 8) -> None:
    """Each row of ``cut``, continued greedily in the batch, equals a fresh state of the row's ids continued alone
    (text and weight), and every clear-cut step is llama.cpp's own argmax with its log-prob."""
    out = gen(cut, max_tokens=n)
    added = (out.weights - cut.weights).flatten().tolist()
    for r, (ids, cont) in enumerate(zip(_rows(cut), _rows(out))):
        alone = gen(_fresh(model, ids), max_tokens=n)
        assert _rows(alone)[0] == cont, f"row {r}: {list(out)[r]!r} vs fresh {str(alone)!r}"
        assert added[r] == pytest.approx(float(alone.weights[0, 0]), abs=1e-3)
        ref = reference_logits("f32", cont, flash_attn=True)
        lp = ref - np.logaddexp.reduce(ref, axis=1, keepdims=True)
        for t in range(len(ids), len(cont)):
            top2 = np.sort(ref[t - 1])[-2:]
            if top2[1] - top2[0] > DECODE_TOL["f32"]:
                assert cont[t] == int(ref[t - 1].argmax()), f"row {r}, token {t}"
        assert added[r] == pytest.approx(float(sum(lp[t - 1, cont[t]] for t in range(len(ids), len(cont)))), abs=0.1)


def test_rows_cut_at_different_places_attend_only_to_their_kept_tokens(model, gen, base):
    texts = list(base)
    ends = [len(texts[0]) - 7, len(texts[1]) - 20]  # a char inside a token in row 0, far back in row 1
    cut = base._truncate(ends)
    kept = cut.cached_tokens.flatten().tolist()
    assert kept[0] != kept[1] and [v.n_tokens for v in cut._kv.views] == kept  # views = the kept cached tokens
    assert torch.equal(cut._kv.cols, cut._mask[:, :kv.length(cut._kv)].bool())
    assert list(cut) == [t[:e] for t, e in zip(texts, ends)]
    _check_like_fresh(model, gen, cut)


def test_one_chars_slice_keeps_different_token_counts_per_row(model, gen, base):
    shortest = min(len(t) for t in base)
    for n in [14, *random.Random(0).sample(range(10, shortest - 1), 2)]:
        cut = base[:, :n]
        assert [v.n_tokens for v in cut._kv.views] == cut.cached_tokens.flatten().tolist()
        _check_like_fresh(model, gen, cut, n=6)


def test_the_forward_never_attends_to_cells_the_mask_cut(model, gen, base):
    cut = base[:, :14]
    C = kv.length(cut._kv)
    stale = base._kv.crop(C)  # views still covering the cut tokens, as before the fix
    state = SequenceState(model=model, ids=cut._ids, mask=cut._mask, logprobs=cut._logprobs, weights=cut._weights,
                          kv=stale, batch=2, samples=1)
    assert [v.n_tokens for v in stale.views] != cut.cached_tokens.flatten().tolist()
    assert list(gen(state, max_tokens=6)) == list(gen(cut, max_tokens=6))  # the forward cuts the views itself
    mask = cut._mask.clone()
    mask[1, int(mask[1, :C].nonzero()[2])] = 0  # a hole in the middle of row 1's cached tokens
    holed = SequenceState(model=model, ids=cut._ids, mask=mask, logprobs=cut._logprobs, weights=cut._weights,
                          kv=cut._kv, batch=2, samples=1)
    with pytest.raises(BackendError, match="recompute the state"):
        gen(holed, max_tokens=2)


def test_stacked_states_continue_like_each_alone(model, gen):
    a = gen("Once upon a time", max_tokens=6)
    b = gen("Lily and Tom went to the park", max_tokens=14)
    p = SequenceState.from_prompts(model, "The cat")  # no KV at all
    stacked = SequenceState.stack([a, b, p])
    assert stacked.cached_tokens.flatten().tolist() == [*a.cached_tokens[0].tolist(), *b.cached_tokens[0].tolist(), 0]
    before = model.tokens_computed
    out = gen(stacked, max_tokens=8)
    assert model.tokens_computed - before <= 3 + 8 * 3 + len(_rows(p)[0])  # the caches were reused
    for r, s in enumerate([a, b, p]):
        alone = gen(s, max_tokens=8)
        assert list(out)[r] == str(alone)
        assert float(out.weights[r, 0]) == pytest.approx(float(alone.weights[0, 0]), abs=1e-4)
