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
