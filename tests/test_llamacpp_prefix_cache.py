"""The prefix cache on llama.cpp (donor sequences, continuum/models/llamacpp/prefix.py): a plain call reuses the
cells of the longest prompt prefix an earlier call computed, computes only the rest, and returns what the same
model without the cache returns (batch-invariant mode: exact, see tests/llamacpp_support.py).
"""

from __future__ import annotations

import pytest
import torch

from continuum import continuous, generate, models, samplers
from continuum.errors import PrefixCacheArgumentError

from llamacpp_support import gguf

DOC = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog. "
       "One day, ")


@pytest.fixture(scope="module")
def cached():
    return models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=2, prefix_cache="16MiB")


@pytest.fixture(scope="module")
def plain():
    return models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=2)


def _shared(tok, a: str, b: str) -> int:
    x, y = tok.encode_prompts([a, b])
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def test_a_second_call_computes_only_its_suffix_and_equals_the_uncached_call(cached, plain):
    ours, ref = (continuous(generate.text(m, samplers.greedy())) for m in (cached, plain))
    first = ours(DOC + "Lily saw a big", max_tokens=10)
    assert str(first) == str(ref(DOC + "Lily saw a big", max_tokens=10))
    prompt = DOC + "the sun was very hot and"
    n, shared = len(cached.tokenizer.encode_prompts([prompt])[0]), _shared(cached.tokenizer, DOC + "Lily saw a big", prompt)
    assert shared > 20
    before, hits = cached.tokens_computed, cached.prefix_cache.stats()["hits"]
    second = ours(prompt, max_tokens=10)
    assert cached.tokens_computed - before == (n - shared) + 9  # the suffix in one prefill, then one per new token
    assert cached.prefix_cache.stats()["hits"] == hits + 1
    again = ref(prompt, max_tokens=10)
    assert str(second) == str(again) and torch.equal(second.weights, again.weights)  # the same logits, bit for bit
    assert str(first) == str(ours(DOC + "Lily saw a big", max_tokens=10))  # the donor was never changed


def test_batches_samples_and_prefill_only_calls_reuse_and_stay_exact(cached, plain):
    prompts = [DOC + "a bird sang", DOC + "the dog ran to"]
    ours, ref = (generate.text(m, samplers.greedy()) for m in (cached, plain))
    ours(DOC + "the cat", max_tokens=2)  # the donor
    before = cached.prefix_cache.stats()["tokens_reused"]
    assert ours(prompts, max_tokens=8) == ref(prompts, max_tokens=8)
    assert cached.prefix_cache.stats()["tokens_reused"] - before >= 2 * 20
    draws = (continuous(generate.text(m, samplers.multinomial(3))) for m in (cached, plain))
    a, b = (g(DOC + "she found a", max_tokens=6, rng=torch.Generator().manual_seed(3)) for g in draws)
    assert list(a) == list(b) and torch.equal(a.weights, b.weights)
    s = continuous(generate.text(cached, samplers.greedy()))(DOC + "Tom came", max_tokens=0)  # prefill only
    assert str(continuous(generate.text(cached, samplers.greedy()))(s, max_tokens=6)) == \
        str(continuous(generate.text(plain, samplers.greedy()))(DOC + "Tom came", max_tokens=6))


def test_budget_bounds_and_clear(plain):
    with pytest.raises(PrefixCacheArgumentError):
        models.llamacpp(gguf("f32"), prefix_cache="lots")
    small = models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=2, prefix_cache=small_budget(plain))
    gen = generate.text(small, samplers.greedy())
    for i in range(4):
        gen(DOC + f"number {i} was", max_tokens=2)
    st = small.prefix_cache.stats()
    assert st["bytes"] <= st["max_bytes"] and st["entries"] >= 1 and st["evictions"] >= 1
    small.prefix_cache.clear()
    assert small.prefix_cache.stats()["entries"] == 0
    assert gen(DOC + "number 9 was", max_tokens=4) == generate.text(plain, samplers.greedy())(DOC + "number 9 was", max_tokens=4)


def small_budget(model) -> int:
    """Room for about one prompt of DOC's length."""
    return int(1.5 * len(model.tokenizer.encode_prompts([DOC])[0]) * model.kv_bytes_per_token)


def test_a_spilled_donor_with_no_room_beside_a_running_step_is_a_miss_not_an_error():
    """The long oracle (gguf, threads, 256 cells): a call's setup found a spilled donor, and the cells were a running
    step's, so its restore was refused and the call failed with "no room to restore a spilled state of 70 tokens".
    Reuse is an optimisation: the call computes its prefix instead, admitted when it fits, and returns what the
    same model without the cache returns."""
    small = dict(batch_invariant=True, n_threads=2, n_ctx=256, n_seq_max=16)
    m, ref = models.llamacpp(gguf("f32"), prefix_cache="8MiB", **small), models.llamacpp(gguf("f32"), **small)
    ours, theirs = (continuous(generate.text(x, samplers.greedy())) for x in (m, ref))
    donor = DOC * 2 + "the ball rolled away"
    ours(donor, max_tokens=1)
    assert m.pool.spill_idle() >= 1  # the donor lives in host bytes now
    long = ours("One day a big dog", max_tokens=200)  # ~206 of the 256 cells: no room left for the donor's
    held = {id(v.seq) for v in long._kv.views}
    m.pool.held = held  # as while a step of a running call holds them (the engine's hold(), cleared after the step)
    misses = m.prefix_cache.stats()["misses"]
    out = ours(donor + " and", max_tokens=4)
    assert m.prefix_cache.stats()["misses"] == misses + 1
    want = theirs(donor + " and", max_tokens=4)
    assert list(out) == list(want)
    assert torch.equal(out.weights, want.weights), (out.weights.item(), want.weights.item())
    assert list(long) == list(theirs("One day a big dog", max_tokens=200))  # the long state is intact


def test_long_prompts_stay_exact_in_the_batch_invariant_mode_however_they_are_split_and_placed(cached, plain):
    """Prompts of 64+ tokens: llama.cpp's tiled flash-attention kernel (64+ query rows in a micro-batch) rounds by where
    a row's cells lie and how its rows are tiled, so a long prompt reused from a donor (its suffix decoded on its own)
    or computed again beside kept cells differed from the call alone (1e-4-6e-4 in a log-prob on the f32 fixture).
    The invariant mode keeps every micro-batch under the tile: bit for bit both ways."""
    long = DOC * 3
    assert len(cached.tokenizer.encode_prompts([long])[0]) >= 80
    ours, ref = (continuous(generate.text(m, samplers.greedy())) for m in (cached, plain))
    ours(long + "the cat sat", max_tokens=2)  # the donor
    hits = cached.prefix_cache.stats()["hits"]
    out = ours(long + "a bird sang", max_tokens=6)
    assert cached.prefix_cache.stats()["hits"] == hits + 1
    first = ref(long + "a bird sang", max_tokens=6)
    again = ref(long + "a bird sang", max_tokens=6)  # its cells after the first one's (kept in this mode)
    assert list(out) == list(first) == list(again)
    assert torch.equal(out.weights, first.weights) and torch.equal(first.weights, again.weights)
