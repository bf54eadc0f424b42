"""Property tests of what a ``SequenceState`` continuation computes (invariant 3 with explicit counts).

For both tiny GPT-2 and tiny Llama: greedy ``max_tokens=a`` then ``b`` equals one call with ``a + b``; continuing
computes the uncached suffix x rows once, then one column per step (after a fresh prompt, a generated state,
``+ text``, a prefill-only call, a fork into samples, a truncation); selecting rows drops padding columns; a
beam fork with ``max_tokens=0`` is a prefill. Random programs checking every invariant after each step:
``test_properties_programs.py``.
"""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from continuum import SequenceState, continuous, generate, samplers

from conftest import chars_key, count_forward_tokens
from properties_support import (
    SETTINGS,
    _one_thread,  # noqa: F401  (autouse: one intra-op thread for this module)
    check_reuse,
    check_suffix,
    fresh_logits,
    greedy_c,
    prompt_lists,
    row_lengths,
    texts,
    uncached,
)


# ---------------------------------------------------------------------------------- standalone invariants
def test_selecting_rows_drops_padding_columns(model):
    s = SequenceState.from_prompts(model, ["a", "a much longer prompt here"])
    one = s[0, :]
    n = len(model.tokenizer.encode_prompts(["a"])[0])
    counter, handle = count_forward_tokens(model)
    try:
        greedy_c(model)(one, max_tokens=1)
    finally:
        handle.remove()
    assert counter["tokens"] == n


def test_beam_fork_prefill_only(model):
    out = continuous(generate.text(model, samplers.beam_search(2)))("Hi", max_tokens=0)
    assert out.shape == (1, 2) and list(out) == ["Hi", "Hi"]


def no_early_stop(state: SequenceState, prompt_state: SequenceState, k: int) -> bool:
    return all(a == b + k for a, b in zip(row_lengths(state), row_lengths(prompt_state)))


@settings(max_examples=40, **SETTINGS)
@given(prompts=prompt_lists, a=st.integers(0, 5), b=st.integers(0, 5))
def test_greedy_split_equals_one_call(model, prompts, a, b):
    """Greedy ``max_tokens=a`` then ``max_tokens=b`` == one greedy call with ``a + b``, token for token."""
    g = greedy_c(model)
    one = g(prompts, max_tokens=a + b)
    assume(no_early_stop(one, SequenceState.from_prompts(model, prompts), a + b))  # EOS ends a row for good
    first = g(prompts, max_tokens=a)
    two = g(first, max_tokens=b)
    assert torch.equal(two.token_ids, one.token_ids)
    assert list(two) == list(one)
    assert torch.allclose(two.weights, one.weights, atol=1e-4)
    nan = torch.isnan(one.token_logprobs)
    assert torch.equal(torch.isnan(two.token_logprobs), nan)
    assert torch.allclose(two.token_logprobs[~nan], one.token_logprobs[~nan], atol=1e-4)


def counted(model, fn):
    counter, handle = count_forward_tokens(model)
    try:
        out = fn()
    finally:
        handle.remove()
    return out, counter["tokens"], counter["calls"]


@settings(max_examples=30, **SETTINGS)
@given(prompts=prompt_lists, k=st.integers(0, 3), m=st.integers(1, 4), extra=texts, n=st.integers(2, 3))
def test_only_the_uncached_suffix_is_computed(model, prompts, k, m, extra, n):
    """Invariant 3 with explicit counts: continuing computes (uncached suffix) x rows, then one column per step."""
    g = greedy_c(model)
    prompt = SequenceState.from_prompts(model, prompts)
    rows = prompt.rows
    s, tokens, _ = counted(model, lambda: g(prompt, max_tokens=k))
    width = max(row_lengths(prompt))
    # a fresh prompt: prefill everything (but the last token when max_tokens=0), then one column per step
    assert tokens == (rows * (width - 1) if k == 0 else rows * width + rows * (k - 1)) or not no_early_stop(s, prompt, k)
    assert uncached(s) == [1] * rows, "a generated state caches all but its last token"

    # continuing a generated state: one position per row, then one per step
    out, tokens, calls = counted(model, lambda: g(s, max_tokens=m))
    if no_early_stop(out, s, m):
        assert (tokens, calls) == (rows * m, m)
    # max_tokens=0 on a generated state computes nothing
    same, tokens, calls = counted(model, lambda: g(s, max_tokens=0))
    assert (tokens, calls) == (0, 0) and list(same) == list(s)

    # after `+ text`: the appended tokens + the one uncached token, then one column per step
    t = s + extra
    appended = [a - b for a, b in zip(row_lengths(t), row_lengths(s))]
    assert appended == [len(model.tokenizer.encode_continuation(extra))] * rows
    out, tokens, calls = counted(model, lambda: g(t, max_tokens=m))
    if no_early_stop(out, t, m):
        assert (tokens, calls) == (rows * (appended[0] + 1) + rows * (m - 1), m)
    # prefill only (max_tokens=0) computes the appended tokens; continuing then computes one position per row
    u, tokens, calls = counted(model, lambda: g(t, max_tokens=0))
    assert tokens == rows * appended[0] and uncached(u) == [1] * rows
    check_reuse(u, fresh_logits(u))
    out, tokens, calls = counted(model, lambda: g(u, max_tokens=m))
    if no_early_stop(out, u, m):
        assert (tokens, calls) == (rows * m, m)

    # forking into n samples: the suffix is computed once per batch row, then n columns per row per step
    fork = continuous(generate.text(model, samplers.multinomial(n)))
    out, tokens, calls = counted(model, lambda: fork(s, max_tokens=m, rng=torch.Generator().manual_seed(0)))
    assert tokens == rows * 1 + (calls - 1) * rows * n
    if max(row_lengths(out)) == max(row_lengths(s)) + m:
        assert calls == m
    # a truncated state keeps the cache of its kept token prefix: only the rest is recomputed
    cut = max(1, min(len(x) for x in s) - 2)
    c = s[chars_key(s, slice(None, cut))]
    check_suffix(c)
    out, tokens, calls = counted(model, lambda: g(c, max_tokens=1))
    assert tokens == rows * max(uncached(c))
