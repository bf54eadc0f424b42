"""The automatic prefix cache (``prefix_cache=``): only the uncached suffix is computed, results are
those of the same model without it (and of a fresh HF forward), the byte budget holds, LRU order,
threads, states unchanged, off by default.

References: the same HF module wrapped without a prefix cache, plain HF forwards over unpadded rows.
"""

from __future__ import annotations

import threading

import pytest
import torch

from continuum import continuous, generate, models, samplers
from continuum.errors import ContinuumTypeError, PrefixCacheArgumentError
from continuum.models.hf.prefix_cache import PrefixCache, parse_budget

from conftest import CORPUS, assert_reuse_exact, check_unchanged, kv_layers, make_bpe_tokenizer, snapshot, tiny_gpt2

PREFIX = " ".join(CORPUS[:2]) + " "  # ~70-110 tokens: several 16-token blocks


def cached_twin(model, budget="4MiB"):
    """The same HF module and tokenizer, with a prefix cache."""
    return models.Transformers(model.model, model.tokenizer, prefix_cache=budget)


def n_ids(model, text: str) -> int:
    return len(model.tokenizer.encode_prompts([text])[0])


@torch.no_grad()
def fresh_token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from one plain HF forward (no padding, no cache)."""
    logits = model.model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def check_against_fresh(state, atol: float = 1e-4) -> None:
    """Every generated token's log-prob (the first one comes from logits over the hit) equals a fresh forward's."""
    for r in range(state.rows):
        mask = state.attention_masks[r].bool()
        ids, lps = state.token_ids[r][mask].tolist(), state.token_logprobs[r][mask]
        gen = ~torch.isnan(lps[1:])
        torch.testing.assert_close(lps[1:][gen], fresh_token_logprobs(state.model, ids)[gen], atol=atol, rtol=0)


def test_budget_arguments(gpt2_model):
    assert parse_budget(None) is None and parse_budget(0) is None and parse_budget("0MiB") is None
    assert parse_budget(1000) == 1000 and parse_budget("512MiB") == 512 * 2**20 and parse_budget("2GB") == 2 * 10**9
    assert parse_budget("1.5 KiB") == 1536
    for bad in (-1, "lots", "12 parsecs", "MiB"):
        with pytest.raises(PrefixCacheArgumentError, match="prefix_cache"):
            models.Transformers(gpt2_model.model, gpt2_model.tokenizer, prefix_cache=bad)
    for bad in (1.5, True, [1]):
        with pytest.raises(ContinuumTypeError, match="byte budget"):
            models.Transformers(gpt2_model.model, gpt2_model.tokenizer, prefix_cache=bad)
    assert gpt2_model.prefix_cache is None  # off by default
    cache = cached_twin(gpt2_model, "1MiB").prefix_cache
    assert cache.stats() == dict(hits=0, misses=0, tokens_reused=0, evictions=0, bytes=0, max_bytes=2**20, entries=0,
                                 block_size=16)


def test_a_hit_computes_only_the_uncached_suffix(model):
    """Second call behind the same prefix: computed positions == uncached suffix + generated - 1 (+ the last
    prompt token is always computed); outputs and log-probs equal the model without a cache and a fresh forward."""
    twin = cached_twin(model)
    gen, ref = continuous(generate.text(twin, samplers.greedy())), continuous(generate.text(model, samplers.greedy()))
    gen(PREFIX + "Once upon", max_tokens=4)
    prompt = PREFIX + "The dog sleeps"
    before, c0 = twin.prefix_cache.stats(), twin.tokens_computed
    state = gen(prompt, max_tokens=6)
    computed, after = twin.tokens_computed - c0, twin.prefix_cache.stats()
    reused = after["tokens_reused"] - before["tokens_reused"]
    n = n_ids(twin, prompt)
    assert after["hits"] == before["hits"] + 1 and reused >= 3 * 16 and reused % 16 == 0
    assert state.finish_reasons == [["length"]]
    assert computed == (n - reused) + (6 - 1)
    expected = ref(prompt, max_tokens=6)
    assert state.last_text == expected.last_text
    torch.testing.assert_close(state.weights, expected.weights, atol=1e-4, rtol=0)
    check_against_fresh(state)
    assert_reuse_exact(state)  # the blocks copied into the state's cache serve the next call exactly


def test_batched_left_padded_rows_differ(model):
    """Rows of one batch hit different lengths (long, short, none), with left padding; then a continued
    batch state whose rows are extended from the cache. Same as without the cache."""
    twin = cached_twin(model)
    gen, ref = continuous(generate.text(twin, samplers.greedy())), continuous(generate.text(model, samplers.greedy()))
    gen([PREFIX + "x", CORPUS[5] + " " + CORPUS[6]], max_tokens=2)  # fills the cache
    prompts = [PREFIX + "The quick brown fox", CORPUS[5] + " Numbers", "Emoji time: 🤗 and more"]
    c0 = twin.tokens_computed
    state = gen(prompts, max_tokens=5)
    expected = ref(prompts, max_tokens=5)
    assert twin.tokens_computed - c0 < sum(n_ids(twin, p) for p in prompts)
    assert state.last_text == expected.last_text
    torch.testing.assert_close(state.weights, expected.weights, atol=1e-4, rtol=0)
    check_against_fresh(state)
    assert_reuse_exact(state)
    # a state continued with text another call cached: its rows take the longer cached prefix
    cut = PREFIX.index(" ", 30)  # at a word boundary: appended text tokenizes as in the whole prompt
    base = ref([PREFIX[:cut], CORPUS[5][:20], CORPUS[9][:30]], max_tokens=0)  # the last row: never cached
    more = base + [PREFIX[cut:] + "The quick", CORPUS[5][20:] + " " + CORPUS[6][:10], " more"]
    hits0 = twin.prefix_cache.stats()["hits"]
    cont = gen(more.to_model(twin), max_tokens=4)
    assert twin.prefix_cache.stats()["hits"] > hits0
    assert cont.last_text == ref(more, max_tokens=4).last_text
    check_against_fresh(cont)
    assert_reuse_exact(cont)


@pytest.mark.parametrize("kind", ["samples", "beams", "choice", "guidance", "prefill"])
def test_samplers_and_generators(model, kind):
    twin = cached_twin(model)

    def build(m):
        if kind == "samples":
            return continuous(generate.text(m, samplers.multinomial(3)))
        if kind == "beams":
            return continuous(generate.text(m, samplers.beam_search(3)))
        if kind == "choice":
            return continuous(generate.choice(m, ["yes", "no", "maybe later"], samplers.greedy()))
        if kind == "guidance":
            return continuous(generate.text(m, samplers.greedy(), guidance_scale=2.0, negative_prompt="The end."))
        return continuous(generate.text(m, samplers.greedy()))

    gen, ref = build(twin), build(model)
    max_tokens = 0 if kind == "prefill" else 4
    prompts = [PREFIX + "Answer:", PREFIX + "Reply now:"]
    gen(PREFIX + "warm", max_tokens=1)  # the prefix blocks are cached
    ours = gen(prompts, max_tokens=max_tokens, rng=torch.Generator().manual_seed(3))
    theirs = ref(prompts, max_tokens=max_tokens, rng=torch.Generator().manual_seed(3))
    assert twin.prefix_cache.stats()["tokens_reused"] >= 2 * 32  # both rows reuse the prefix blocks
    assert list(ours) == list(theirs)
    torch.testing.assert_close(ours.weights, theirs.weights, atol=1e-4, rtol=0)
    if kind in ("samples", "beams", "prefill"):
        check_against_fresh(ours)
    assert_reuse_exact(ours)


def test_eviction_order_and_byte_bound(gpt2_model):
    """Budget of 3 blocks: leaves go first, least recently used first; bytes never exceed the budget."""
    tok = gpt2_model.tokenizer
    block = 2 * 2 * 2 * 16 * 16 * 4  # layers x (k, v) x heads x 16 tokens x head_dim 16 x fp32
    twin = cached_twin(gpt2_model, 3 * block)
    cache = twin.prefix_cache
    gen = continuous(generate.text(twin, samplers.greedy()))
    a, b = tok.encode_prompts([CORPUS[0] + " " + CORPUS[1]])[0], tok.encode_prompts([CORPUS[6]])[0]
    assert len(a) > 3 * 16 + 1 and 2 * 16 < len(b) <= 3 * 16 and a[:16] != b[:16]
    text_a, text_b = tok.decode(a[:3 * 16 + 1]), tok.decode(b[:2 * 16 + 1])
    bound = []

    def call(text):
        gen(text, max_tokens=1)
        s = cache.stats()
        bound.append(s["bytes"] <= s["max_bytes"])
        return s

    s = call(text_a)
    assert (s["entries"], s["bytes"], s["evictions"]) == (3, 3 * block, 0)
    s = call(text_b)  # B's 2 blocks evict A's last two (leaves first: A2, then A1)
    assert (s["entries"], s["evictions"]) == (3, 2)
    s = call(text_a)  # A0 is still there (1 block reused); A1, A2 come back and evict B1, then B0
    assert (s["hits"], s["tokens_reused"], s["evictions"]) == (1, 16, 4)
    s = call(text_b)  # B was evicted entirely: a miss (and B's blocks evict A's leaves again)
    assert (s["misses"], s["hits"]) == (3, 1)
    assert all(bound) and cache.stats()["bytes"] <= 3 * block
    small = cached_twin(gpt2_model, block // 2)  # not even one block fits: never holds anything
    continuous(generate.text(small, samplers.greedy()))(text_a, max_tokens=1)
    assert small.prefix_cache.stats()["bytes"] == 0 == small.prefix_cache.stats()["entries"]


def test_four_threads_equal_sequential_calls(gpt2_model):
    prompts = [PREFIX + CORPUS[i % 10][:20] for i in range(8)]
    reference = [generate.text(gpt2_model, samplers.greedy())(p, max_tokens=4) for p in prompts]
    block = 2 * 2 * 2 * 16 * 16 * 4
    for budget in ("4MiB", 6 * block):  # roomy, and small enough to evict while threads read
        twin = cached_twin(gpt2_model, budget)
        gen = generate.text(twin, samplers.greedy())
        results, bound, errors = [None] * len(prompts), [], []

        def work(i0):  # reads this iteration's gen/twin/results/bound/errors: the threads are joined below, in it
            try:
                for i in range(i0, len(prompts), 4):
                    results[i] = gen(prompts[i], max_tokens=4)  # noqa: B023
                    s = twin.prefix_cache.stats()  # noqa: B023
                    bound.append(s["bytes"] <= s["max_bytes"])  # noqa: B023
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)  # noqa: B023

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and results == reference and all(bound)
        assert twin.prefix_cache.stats()["hits"] > 0


def test_states_and_forks_unchanged(gpt2_model):
    twin = cached_twin(gpt2_model)
    gen = continuous(generate.text(twin, samplers.greedy()))
    fork = continuous(generate.text(twin, samplers.multinomial(3)))
    first = gen(PREFIX + "One", max_tokens=3)
    snap = snapshot(first)
    second = gen(PREFIX + "Two", max_tokens=3)  # a hit on the blocks `first` computed
    forked = fork(first, max_tokens=2, rng=torch.Generator().manual_seed(0))
    cont = gen(first + " and more", max_tokens=3)
    sliced = gen(first[..., :-5], max_tokens=2)
    check_unchanged(first, snap)
    assert twin.prefix_cache.stats()["hits"] >= 1
    held = {t.untyped_storage().data_ptr() for b in twin.prefix_cache._blocks.values() for pair in b.kv for t in pair}
    for s in (first, second, forked, cont, sliced):  # no state shares storage with the cache
        assert not held & {t.untyped_storage().data_ptr() for pair in kv_layers(s) for t in pair}
        assert_reuse_exact(s)
    twin.prefix_cache.clear()
    assert twin.prefix_cache.stats()["entries"] == 0
    assert gen(second, max_tokens=2).last_text == continuous(generate.text(gpt2_model, samplers.greedy()))(
        second.to_model(gpt2_model), max_tokens=2).last_text


def test_off_by_default_and_identity():
    """No cache: every call computes its whole prompt. A dtype change empties the cache."""
    tok = make_bpe_tokenizer()
    hf = tiny_gpt2(len(tok), seed=5)
    off, on = models.Transformers(hf, tok), models.Transformers(hf, tok, prefix_cache="1MiB")
    assert off.prefix_cache is None and isinstance(on.prefix_cache, PrefixCache)
    prompt = PREFIX + "Again"
    for _ in range(2):
        c0 = off.tokens_computed
        generate.text(off, samplers.greedy())(prompt, max_tokens=1)
        assert off.tokens_computed - c0 == n_ids(off, prompt)
    gen = continuous(generate.text(on, samplers.greedy()))
    gen(prompt, max_tokens=1)
    assert on.prefix_cache.stats()["entries"] > 0
    hf.double()
    state = gen(prompt, max_tokens=3)  # the float32 blocks are dropped, nothing is reused
    s = on.prefix_cache.stats()
    assert s["hits"] == 0 and state._kv.dtype() == torch.float64
    check_against_fresh(state, atol=1e-9)
    state = gen(prompt, max_tokens=3)
    assert on.prefix_cache.stats()["hits"] == 1
    check_against_fresh(state, atol=1e-9)
