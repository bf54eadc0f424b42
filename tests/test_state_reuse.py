"""SequenceState: the reuse invariants. Logits through a reused cache equal a fresh forward after generating,
slicing, adding, forking and continuing (also with real tokenizers); no operation mutates its inputs, in-place
appends never change other states; only the uncached suffix is computed and a fork prefills once; beams re-rank
whole sequences across turns; chained text, choice and JSON steps; a stream ends with its state.
Indexing, adding and stacking: ``test_state_algebra.py``; saving and loading: ``test_state_persistence.py``."""

from __future__ import annotations

import math

import torch

from continuum import SequenceState, continuous, generate, samplers

from conftest import assert_reuse_exact, count_forward_tokens, kv_layers
from state_support import PROMPTS, greedy_c


def snapshot(state: SequenceState):
    tensors = [state._ids, state._mask, state._logprobs, state._weights] + [t for kv in kv_layers(state) for t in kv]
    return [t.clone() for t in tensors], tensors


def assert_unchanged(snap):
    copies, tensors = snap
    for a, b in zip(copies, tensors):
        assert torch.equal(a.nan_to_num(0), b.nan_to_num(0))


# ---------------------------------------------------------------- reuse invariants
def test_reuse_after_generate_slice_add_fork_continue(model):
    g = greedy_c(model)
    s1 = g(PROMPTS, max_tokens=6)
    assert_reuse_exact(s1)
    s2 = s1[:, :12]
    assert_reuse_exact(s2)
    s3 = s2 + " and then"
    assert_reuse_exact(s3)
    s4 = g(s3, max_tokens=4)
    assert_reuse_exact(s4)
    s5 = continuous(generate.text(model, samplers.multinomial(2)))(s4, max_tokens=3, rng=torch.Generator().manual_seed(0))
    assert_reuse_exact(s5)
    s6 = s5[1:, :, :-3] + ["x", "東"]
    assert_reuse_exact(s6)
    s7 = s4 + s4
    assert_reuse_exact(s7)


def test_greedy_split_equals_one_call(model):
    g = greedy_c(model)
    whole = g(PROMPTS, max_tokens=9)
    split = g(g(PROMPTS, max_tokens=4), max_tokens=5)
    assert list(split) == list(whole)
    assert torch.allclose(split.weights, whole.weights, atol=1e-4)


def test_resume_after_slice_equals_fresh_prompt(model):
    g = greedy_c(model)
    s = g(PROMPTS[:2], max_tokens=8)
    cut = s[:, :14]
    fresh = g([t[:14] for t in s], max_tokens=5)
    resumed = g(cut, max_tokens=5)
    # same text; token boundaries at the cut may differ from a fresh tokenization, so compare
    # against the same token ids run without cache instead
    assert [t[:14] for t in s] == [t[:14] for t in resumed]
    assert_reuse_exact(resumed)
    assert len(list(fresh)) == 2


# ---------------------------------------------------------------- immutability
def test_operations_never_mutate_inputs(model):
    g = greedy_c(model)
    s = g(PROMPTS, max_tokens=5)
    snap = snapshot(s)
    a = g(s, max_tokens=3)
    b = g(s, max_tokens=3)
    assert list(a) == list(b) and torch.equal(a.weights, b.weights)
    _ = s[:, :5], s + "x", s + s, "p" + s, s[1, :3]
    continuous(generate.text(model, samplers.beam_search(3)))(s, max_tokens=2)
    continuous(generate.choice(model, ["a", "b"]))(s)
    assert_unchanged(snap)


def test_in_place_appends_never_change_other_states(model):
    """New KV columns are written into preallocated storage (cache.py): only the state whose cache
    ends where the storage was last written may append in place; any other must copy first."""
    g = greedy_c(model)
    s = g(PROMPTS, max_tokens=4)
    a = g(s, max_tokens=3)  # appends in place after s's columns
    storage = lambda st: kv_layers(st)[0][0].untyped_storage().data_ptr()  # noqa: E731
    assert storage(a) == storage(s)
    snap_s, snap_a = snapshot(s), snapshot(a)
    b = g(s, max_tokens=3)  # a already wrote past s: b must not write there
    assert storage(b) != storage(s)
    a2, a3 = g(a, max_tokens=2), g(a, max_tokens=2)
    cut = g(s[:, :-2], max_tokens=3)
    beams = continuous(generate.text(model, samplers.beam_search(2)))(a, max_tokens=3)
    beams2 = continuous(generate.text(model, samplers.beam_search(2)))(beams, max_tokens=2)
    assert_unchanged(snap_s)
    assert_unchanged(snap_a)
    assert list(a) == list(b) and list(a2) == list(a3)
    for state in (s, a, b, a2, a3, cut, beams, beams2):
        assert_reuse_exact(state)


# ---------------------------------------------------------------- only the suffix is computed
def test_only_uncached_suffix_is_computed(model):
    g = greedy_c(model)
    s = g("Once upon a time", max_tokens=5)
    counter, handle = count_forward_tokens(model)
    try:
        g(s, max_tokens=4)
        assert counter["tokens"] == 1 + 3 and counter["calls"] == 4
        counter["tokens"] = counter["calls"] = 0
        text = " and a dragon 🐉"
        n_text = len(model.tokenizer.encode_continuation(text))
        g(s + text, max_tokens=3)
        assert counter["tokens"] == (1 + n_text) + 2
        assert counter["calls"] == 3  # ONE prefill call for the whole suffix
    finally:
        handle.remove()


def test_fork_prefills_once_and_shares_cache(model):
    s = greedy_c(model)("Once upon a time", max_tokens=4)
    fork = continuous(generate.text(model, samplers.multinomial(4)))(s, max_tokens=0)
    assert fork.shape == (1, 4)
    base = kv_layers(s)[0][0].untyped_storage().data_ptr()
    assert all(k.untyped_storage().data_ptr() == base for k, _ in kv_layers(fork)[:1])
    assert_reuse_exact(fork)

# ---------------------------------------------------------------- beam search across turns
def test_beam_search_across_turns_reranks_whole_sequences(model):
    beam = continuous(generate.text(model, samplers.beam_search(3)))
    s1 = beam("Once upon a time", max_tokens=3)
    s2 = beam(s1 + ",", max_tokens=3)
    assert s2.shape == (1, 3)
    w = s2.weights[0].tolist()
    assert w == sorted(w, reverse=True)
    # cumulative weights: each beam's weight is its whole sequence's generated log-prob
    lp = s2.token_logprobs
    for r in range(3):
        assert math.isclose(w[r], float(lp[r][~lp[r].isnan()].sum()), abs_tol=1e-3)
    assert_reuse_exact(s2)
    # a choice over the beams keeps 3 best (beam, option) pairs
    s3 = continuous(generate.choice(model, [" yes", " no"], samplers.beam_search(3)))(s2)
    assert s3.shape == (1, 3) and all(v in (" yes", " no") for v in s3.value)


# ---------------------------------------------------------------- chaining and values
def test_chain_text_choice_json(model):
    from pydantic import BaseModel, Field

    class Item(BaseModel):
        ok: bool
        name: str = Field(max_length=5)

    s1 = greedy_c(model)("Review: great phone.", max_tokens=5)
    s2 = continuous(generate.choice(model, ["Positive", "Negative"]))(s1 + "\nSentiment: ")
    assert s2.value in ("Positive", "Negative")
    s3 = continuous(generate.json(model, Item, samplers.greedy()))(s2 + "\nJSON: ", max_tokens=40)
    assert isinstance(s3.value, Item)
    assert list(s3)[0].startswith(list(s2)[0])
    s4 = greedy_c(model)(s3[:10], max_tokens=3)
    assert list(s4)[0].startswith("Review: g")
    assert_reuse_exact(s4)


# ---------------------------------------------------------------- streams, real tokenizers
def test_stream_of_continuous_generator_ends_with_state(model):
    g = greedy_c(model)
    s = g("Once", max_tokens=2)
    stream = g.stream(s, max_tokens=5)
    text = "".join(stream)
    assert list(stream.state)[0] == list(s)[0] + text
    assert list(stream.state) == list(g(s, max_tokens=5))


def test_real_tokenizers_slice_and_resume(real_tokenizer_model):
    g = greedy_c(real_tokenizer_model)
    s = g(["Héllo wörld 🤗 ok", "東京は日本"], max_tokens=6)
    for n in (3, 7, 9):
        cut = s[:, :n]
        assert list(cut) == [t[:n] for t in s]
        assert_reuse_exact(cut)
        assert_reuse_exact(cut + "🦙 the")
