"""Samplers on their own (no model): arguments, greedy's argmax, top-p, and the multinomial draw (the exponential
race) against exact probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from continuum import samplers


def test_samplers_validate_arguments():
    with pytest.raises(ValueError):
        samplers.multinomial(0)
    with pytest.raises(ValueError):
        samplers.multinomial(2, top_p=1.5)
    with pytest.raises(ValueError):
        samplers.beam_search(0)
    assert samplers.BeamSearchSampler(3).samples == 3
    assert isinstance(samplers.greedy(), samplers.GreedySampler)
    assert "MultinomialSampler(4" in repr(samplers.multinomial(4, temperature=0.7, top_k=50, top_p=0.9))


@pytest.mark.parametrize("wide", [False, True])
def test_greedy_row_max_is_torchs_max(wide, monkeypatch):
    """``samplers.row_max`` (numpy's argmax on CPU float32 over wide rows) picks what ``torch.max`` picks: ties (the
    first), NaN (the largest), rows all -inf, infinities, non-contiguous rows, other dtypes, a gradient."""
    if wide:  # (every case on the numpy path)
        monkeypatch.setattr(samplers, "NUMPY_ARGMAX_FROM", 1)
    inf, nan = math.inf, math.nan
    gen = torch.Generator().manual_seed(0)
    cases = [torch.tensor([[1.0, 3.0, 3.0, 2.0], [-inf, -inf, -inf, -inf], [1.0, nan, 5.0, nan], [inf, 1.0, inf, 0.0],
                           [-inf, 0.0, -inf, 0.0]]),
             torch.randn(9, 1000, generator=gen), torch.randn(6, 40, generator=gen)[:, ::3],
             torch.randn(6, 40, generator=gen).t(), torch.randint(0, 3, (8, 50), generator=gen).float(),
             torch.randn(4, 30, generator=gen, dtype=torch.float64), torch.randn(3, 7, generator=gen).requires_grad_()]
    for x in cases:
        best, ids = samplers.row_max(x)
        want = x.max(-1)
        assert ids.tolist() == want.indices.tolist() == x.argmax(-1).tolist()
        torch.testing.assert_close(best, want.values, rtol=0, atol=0, equal_nan=True)
        ids, _, best = samplers.greedy()(x.detach(), torch.zeros(x.shape[0]), 1)
        assert ids.tolist() == want.indices.tolist()


def _nucleus_by_sorting(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """top-p by a full sort in float64 (the textbook way): which tokens it drops, and which lie so close to the
    boundary (the probability before them within 1e-5 of top_p) that float32 rounding may decide either way."""
    sorted_logits, order = logits.double().sort(dim=-1, descending=True)
    p = sorted_logits.softmax(-1)
    before = p.cumsum(-1) - p
    drop, close = before >= top_p, (before - top_p).abs() < 1e-5
    return drop.scatter(-1, order, drop), close.scatter(-1, order, close)


@pytest.mark.parametrize("vocab,scale", [(50, 1.0), (3000, 0.05), (3000, 3.0), (20000, 0.01)])
def test_top_p_keeps_what_a_full_sort_keeps(vocab, scale):
    """``samplers._nucleus`` sorts only the most likely tokens, more while some row's set reaches past them (a flat
    distribution: thousands of tokens); it keeps exactly the tokens a full sort keeps, masked tokens included."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen) * scale
    logits[1, ::3] = -math.inf  # (a row a guide or top-k masked first)
    for top_p in (0.05, 0.5, 0.9, 0.999):
        drop, close = _nucleus_by_sorting(logits, top_p)
        got = samplers._nucleus(logits, top_p)
        dropped = torch.isinf(got) & ~torch.isinf(logits)
        assert torch.equal((dropped | torch.isinf(logits))[~close], (drop | torch.isinf(logits))[~close]), top_p
        assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])  # (kept tokens keep their logits)
        assert int(close.sum()) <= 0.01 * close.numel()  # (the band is a tie-break, not where the answer hides)


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    seen = expected > 0
    assert int(counts[~seen].sum()) == 0, "a token of probability 0 was drawn"
    return float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())


def test_race_draws_the_distribution():
    """``exponential_race`` draws each token with its probability: a chi-square test against the exact
    probabilities (brute force), tokens of probability 0 never drawn, on a small vocabulary and on a wide one."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0375, 0.025, 0.0, 0.0])
    ids = samplers.exponential_race(p.expand(40000, -1).contiguous(), gen)
    assert _chi_square(torch.bincount(ids, minlength=8).double(), p.double()) < 24.3  # 5 dof, p = 0.0002
    logits = torch.randn(300000, generator=gen)[:50000] * 2
    logits[::7] = -math.inf
    p = logits.softmax(-1)
    ids = samplers.exponential_race(p.expand(4000, -1).contiguous(), gen)
    order = p.argsort(descending=True)  # buckets of ~equal probability, most likely first
    bucket = torch.empty_like(order)
    bucket[order] = (p[order].cumsum(0) * 20).long().clamp(max=19)
    counts = torch.bincount(bucket[ids], minlength=20).double()
    mass = torch.zeros(20, dtype=torch.float64).index_add_(0, bucket, p.double())
    assert _chi_square(counts, mass) < 50.5  # 19 dof, p = 0.0001
    assert not bool(torch.isinf(logits[ids]).any())


def test_race_resolves_rare_tokens():
    """Tokens of probability ~3e-7 (a wide vocabulary behind one likely token) win as often as they should, ~1% of
    draws in all: a race over the most likely tokens only (a tempting shortcut over a large vocabulary) never draws
    them."""
    V, n = 32768, 10000
    logits = torch.full((V,), -15.0)
    logits[0] = 0.0
    p = logits.softmax(-1)
    rare = float(p[1:].sum())  # ~0.01, from tokens of ~3.1e-7 each
    gen = torch.Generator().manual_seed(1)
    drawn = sum(int((samplers.exponential_race(p.expand(1000, -1).contiguous(), gen) > 0).sum()) for _ in range(10))
    sd = math.sqrt(n * rare * (1 - rare))
    assert abs(drawn - n * rare) < 4.5 * sd, (drawn, n * rare)


def test_race_keeps_its_draw_under_rounding_noise():
    """A seeded draw keeps its tokens when the probabilities move by rounding (llama.cpp's logits depend on the
    batch): each token races with its own exponential. A draw by inverting the cumulative distribution moves with
    every token before the drawn one: 50 of these 256 flat rows drew another token under the same noise."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(256, 30000, generator=gen) * 0.5
    noisy = logits + torch.randn(256, 30000, generator=gen) * 3e-3
    a = samplers.exponential_race(logits.softmax(-1), torch.Generator().manual_seed(7))
    b = samplers.exponential_race(noisy.softmax(-1), torch.Generator().manual_seed(7))
    assert int((a != b).sum()) <= 2  # (0 measured; a seeded inverse-CDF draw moved 50 of these 256 rows)
    c = samplers.exponential_race(logits.softmax(-1), torch.Generator().manual_seed(8))
    assert int((a != c).sum()) >= 240  # (another seed: other draws)


def test_race_on_rows_nothing_allows():
    """A row whose tokens are all forbidden (zeros, or NaN from a softmax of -inf) draws token 0, whose -inf log-prob
    then ends the row as dead (the decoding loop's rule), instead of an error from the draw."""
    p = torch.tensor([[0.0, 0.0, 0.0], [math.nan] * 3, [0.0, 0.0, 1.0]])
    assert samplers.exponential_race(p, torch.Generator().manual_seed(0)).tolist() == [0, 0, 2]
