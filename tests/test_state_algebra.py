"""SequenceState: the algebra. Indexing (shorthands, arity errors, ellipsis, int chars), slicing (weights keep whole
generated tokens, a start recomputes, rows cut at different token counts), adding text, lists and states, sample
and batch mismatches, stacking states of every layout (and a joint call's rows) back as they were; repr, str and
the real rows of many rows. The reuse invariants: ``test_state_reuse.py``; saving and loading:
``test_state_persistence.py``."""

from __future__ import annotations

import math

import pytest
import torch

from continuum import BatchMismatch, SampleMismatch, SequenceState, SlicingError, continuous, generate, samplers

from conftest import assert_reuse_exact, count_forward_tokens, kv_layers
from state_support import PROMPTS, greedy_c


# ---------------------------------------------------------------- indexing
def test_index_shorthands_and_arity_errors(model):
    g = greedy_c(model)
    one = g("Once upon a time", max_tokens=3)
    assert isinstance(one[:5], SequenceState) and list(one[:5]) == [list(one)[0][:5]]
    assert one[0] == list(one)[0][0]
    assert list(one[0, 0, :4]) == [list(one)[0][:4]]  # the full form always works
    with pytest.raises(IndexError, match=r"state\[chars\]"):
        one[0, :3]
    batch = g(PROMPTS, max_tokens=3)
    assert list(batch[1, :4]) == [list(batch)[1][:4]]
    assert batch[:, 0] == [t[0] for t in batch]
    with pytest.raises(IndexError, match=r"state\[batch, chars\]"):
        batch[:3]
    with pytest.raises(IndexError, match="out of range"):
        batch[5, :3]
    samples = continuous(generate.text(model, samplers.multinomial(2)))("x", max_tokens=3)
    assert samples.shape == (1, 2)
    assert list(samples[1, :2]) == [list(samples)[1][:2]]
    with pytest.raises(IndexError, match=r"state\[sample, chars\]"):
        samples[:2]
    with pytest.raises(SlicingError, match="step"):
        batch[:, ::2]
    with pytest.raises(SlicingError, match="selects no rows"):
        batch[3:, :]


def test_index_with_ellipsis_works_for_any_shape(model):
    batch = continuous(generate.text(model, samplers.multinomial(2)))(PROMPTS[:2], max_tokens=3,
                                                                     rng=torch.Generator().manual_seed(0))
    texts = list(batch)
    assert list(batch[..., :6]) == [t[:6] for t in texts]
    assert list(batch[..., :6]) == list(batch[:, :, :6])
    assert batch[..., :6].cached_tokens.shape == (2, 2)
    assert list(batch[1, ...]) == texts[2:]
    assert list(batch[...]) == texts
    assert batch[..., 0] == [t[0] for t in texts]
    one = greedy_c(model)("Once upon a time", max_tokens=3)
    assert list(one[..., :4]) == [list(one)[0][:4]]
    with pytest.raises(IndexError, match="at most one"):
        batch[..., 0, ...]
    with pytest.raises(IndexError, match="at most one"):
        batch[0, 0, ..., :3]


def test_index_with_int_chars_returns_characters(model):
    batch = greedy_c(model)(PROMPTS, max_tokens=2)
    assert batch[0, 0] == PROMPTS[0][0]
    assert batch[:, 1] == [p[1] for p in PROMPTS]


def test_slicing_weights_keep_whole_generated_tokens(model):
    s = greedy_c(model)(PROMPTS[:1], max_tokens=10)
    text = list(s)[0]
    for n in (len(PROMPTS[0]), len(PROMPTS[0]) + 3, len(text) - 1, len(text)):
        cut = s[:n]
        assert list(cut) == [text[:n]]
        lp = cut.token_logprobs[0]
        assert math.isclose(float(cut.weights), float(lp[~lp.isnan()].sum()), abs_tol=1e-4)
    assert float(s[:len(PROMPTS[0])].weights) == 0.0


def test_slice_with_start_recomputes(model):
    s = greedy_c(model)("Once upon a time", max_tokens=6)
    mid = s[5:]
    assert list(mid) == [list(s)[0][5:]]
    assert mid._kv is None
    greedy_c(model)(mid, max_tokens=2)


def test_slicing_batched_rows_at_different_token_counts(model):
    g = greedy_c(model)
    s = g(PROMPTS, max_tokens=6)
    cut = s[:, :-4]
    assert list(cut) == [t[:-4] for t in s]
    assert_reuse_exact(cut)
    counter, handle = count_forward_tokens(model)
    try:
        resumed = g(cut, max_tokens=2)
    finally:
        handle.remove()
    uncached = cut._ids.shape[1] - cut._kv.length()
    assert counter["tokens"] == cut.rows * uncached + cut.rows  # suffix once, then one column
    assert_reuse_exact(resumed)


# ---------------------------------------------------------------- adding
def test_add_text_and_lists(model):
    s = greedy_c(model)(PROMPTS[:2], max_tokens=3)
    assert list(s + "!") == [t + "!" for t in s]
    assert list(s + ["a", "b"]) == [t + x for t, x in zip(s, ["a", "b"])]
    assert torch.equal((s + "!").weights, s.weights)
    with pytest.raises(BatchMismatch, match="batch=2"):
        s + ["a", "b", "c"]
    assert list("> " + s) == ["> " + t for t in s]
    assert torch.equal(("> " + s).weights, s.weights)


def test_add_states(model):
    g = greedy_c(model)
    a, b = g(PROMPTS[:2], max_tokens=3), g(PROMPTS[1:], max_tokens=3)
    ab = a + b
    assert list(ab) == [x + y for x, y in zip(a, b)]
    assert torch.allclose(ab.weights, a.weights + b.weights)
    with pytest.raises(BatchMismatch):
        a + g(PROMPTS, max_tokens=1)
    multi = continuous(generate.text(model, samplers.multinomial(2)))(PROMPTS[:2], max_tokens=2)
    with pytest.raises(SampleMismatch):
        a + multi


def test_sample_mismatch_on_continue(model):
    multi = continuous(generate.text(model, samplers.multinomial(2)))("x", max_tokens=2)
    with pytest.raises(SampleMismatch, match="multinomial\\(2\\)"):
        greedy_c(model)(multi, max_tokens=2)
    with pytest.raises(SampleMismatch):
        continuous(generate.text(model, samplers.beam_search(3)))(multi, max_tokens=2)
    # the input stays usable
    assert len(list(continuous(generate.text(model, samplers.multinomial(2)))(multi, max_tokens=2))) == 2


def test_continue_list_of_states_stacks(model):
    g = greedy_c(model)
    a, b = g("Once", max_tokens=2), g("The dog", max_tokens=2)
    stacked = SequenceState.stack([a, b + " and", "x" + a])
    assert list(stacked) == [list(a)[0], list(b)[0] + " and", "x" + list(a)[0]]
    assert stacked.cached_tokens.flatten().tolist() == [int(a.cached_tokens), int(b.cached_tokens), 0]
    assert_reuse_exact(stacked)
    both = g([a, b], max_tokens=3)
    assert both.shape == (2, 1)
    assert list(both) == [list(g(a, max_tokens=3))[0], list(g(b, max_tokens=3))[0]]


def test_stacking_many_states_lays_each_row_out_as_it_was(model):
    """``SequenceState.stack`` of states of every layout (one row of a batch, a two-row state, a cut, a state with no
    cache, uncached suffixes of several lengths), as run_batch's joint calls stack their callers' states: each row's
    cached columns end at the widest cache, its suffix at the end, its KV columns are its own with zeros before them
    (masked, never NaN), and continuing through the stacked cache gives the logits of a fresh pass (invariant 1)."""
    g = greedy_c(model)
    batch = g(["Once upon a time", "The dog", "Le café 東京 🤗"], max_tokens=4)
    parts = [batch[1, :], batch[0:2, :], batch[2, :5] + " then", SequenceState.from_prompts(model, ["hello there"]),
             batch[0, :] + " and so on", g("A", max_tokens=1)]
    _assert_stacked_as_they_were(parts)


def test_a_joint_calls_rows_stack_back_as_they_were(model):
    """The states a joint call hands its callers (``loop/coalesce._split``: lazy views of the joint cache, short
    callers' rows copied out together) stacked again, as run_batch's next joint call does, mixed with text added, cuts,
    another joint call's rows and a state of its own: the same layout as above, read against each part's own cache.
    A short caller's cache does not keep the joint call's storage alive; a long one's is a view of it."""
    from continuum.loop.coalesce import _split

    g = greedy_c(model)
    prompts = ["Once upon a time there was a very long story about", "The dog", "Le café 東京 🤗", "A",
               "She said that the weather", "Hi"]
    joint = g(prompts, max_tokens=4)
    callers = [SequenceState.from_prompts(model, [p]) for p in prompts[:2]] + \
        [SequenceState.from_prompts(model, prompts[2:4])] + [SequenceState.from_prompts(model, [p]) for p in prompts[4:]]
    parts = _split(joint, callers)
    assert [list(p) for p in parts] == [[t] for t in list(joint)[:2]] + [list(joint)[2:4]] + [[t] for t in list(joint)[4:]]
    other = _split(g(["Why", "Because it"], max_tokens=3), [SequenceState.from_prompts(model, [p]) for p in ["Why", "B"]])
    mixed = [parts[0], parts[1] + " and then", parts[2], parts[3][:4], other[1], parts[4] + "!", other[0],
             SequenceState.from_prompts(model, ["hello there"]), parts[2][1, :]]
    _assert_stacked_as_they_were(mixed)
    _assert_stacked_as_they_were(parts[1:])  # (callers in order, one missing: gathered from the joint cache)
    assert SequenceState.stack(parts) is joint  # (every caller in order: the joint result, as it was)
    joint_storage = kv_layers(joint)[0][0].untyped_storage().data_ptr()
    C = kv_layers(joint)[0][0].shape[2]
    for p in parts:
        k = kv_layers(p)[0][0]
        short = 2 * k.shape[2] < C
        assert (k.untyped_storage().data_ptr() == joint_storage) is not short, (k.shape, C)
        assert_reuse_exact(p)


def test_a_joint_calls_parts_are_made_when_read_as_their_rows_of_it(model):
    """A caller's rows of a joint call (``state/deferred.Part``) make no tensor until read; handed back to the model
    they stay unbuilt. Read, each part's tensors are its rows of the joint result's (real tokens, log-probs, mask),
    its cached counts its rows', its cache reused exactly (a fresh forward over its tokens); reading one changes
    neither the joint result nor another part."""
    from continuum.loop.coalesce import _split
    from continuum.state.deferred import Part

    g = greedy_c(model)
    prompts = ["Once upon a time there was a very long story about", "The dog", "Le café 東京 🤗", "Hi"]
    joint = g(prompts, max_tokens=3)
    before = (joint._ids.clone(), joint._mask.clone(), joint._logprobs.clone(), [t.clone() for t in kv_layers(joint)[0]])
    parts = _split(joint, [SequenceState.from_prompts(model, [p]) for p in prompts])
    assert all(type(p) is Part and p._pending for p in parts)
    assert all(p.to_model(model) is p and p._pending for p in parts)  # (the next call's check builds nothing)
    assert [list(p) for p in parts] == [[t] for t in joint]
    cached = joint.cached_tokens.tolist()
    for i, p in enumerate(parts):
        real, mine = joint._mask[i].bool(), p._mask[0].bool()
        assert not p._pending
        assert p._ids[0][mine].tolist() == joint._ids[i][real].tolist()
        torch.testing.assert_close(p._logprobs[0][mine], joint._logprobs[i][real], equal_nan=True, rtol=0, atol=0)
        assert p.cached_tokens.tolist() == [cached[i]] and torch.equal(p.weights, joint.weights[i:i + 1])
        assert all(q._pending for q in parts[i + 1:])  # (one read builds one part)
        assert_reuse_exact(p)
    ids, mask, logprobs, (k, v) = before  # invariant 2
    assert torch.equal(joint._ids, ids) and torch.equal(joint._mask, mask)
    assert torch.equal(joint._logprobs.nan_to_num(), logprobs.nan_to_num())
    assert torch.equal(kv_layers(joint)[0][0], k) and torch.equal(kv_layers(joint)[0][1], v)


def test_text_added_to_every_caller_stacks_as_one_sum_on_the_joint_result(model):
    """``part + text`` on a joint call's caller is built when first read (``state/deferred.py``); stacked with every
    other caller's, in order, it is ONE sum on the joint result (run_batch's next joint call). Either way each row
    holds its text and tokens as the joint result plus the text does, its cache reused exactly (a fresh forward over
    its tokens), and the parts, the joint result and the sums are unchanged by being read or stacked."""
    from continuum.loop.coalesce import _split
    from continuum.state.deferred import Deferred

    g = greedy_c(model)
    prompts = ["Once upon a time there was a very long story about", "The dog", "Le café 東京 🤗", "Hi"]
    joint = g(prompts, max_tokens=3)
    parts = _split(joint, [SequenceState.from_prompts(model, [p]) for p in prompts])
    before = [(p._ids.clone(), p._mask.clone(), [t.clone() for t in kv_layers(p)[0]]) for p in parts]
    tails = [" and then", "!", " 東京", "\nMood:"]
    lone = joint + tails  # (the lockstep list call's sum, on all rows at once)
    sums = [p + t for p, t in zip(parts, tails)]
    assert all(type(s) is Deferred for s in sums)
    assert [list(s) for s in sums] == [[t] for t in lone]  # (known without building anything)
    stacked = SequenceState.stack(sums)
    assert list(stacked) == list(lone) and _rows_of(stacked) == _rows_of(lone)
    assert stacked.cached_tokens.tolist() == lone.cached_tokens.tolist()
    assert_reuse_exact(stacked)
    for s, r in zip(sums, lone._real_rows()):  # each sum built alone, read against its own tensors
        assert s._ids[s._mask.bool()].tolist() == r[0]
        assert_reuse_exact(s)
    assert SequenceState.stack([sums[0], parts[1]] + sums[2:]).batch == 4  # (mixed: each built, then stacked)
    for p, (ids, mask, (k, v)) in zip(parts, before):  # invariant 2
        assert torch.equal(p._ids, ids) and torch.equal(p._mask, mask)
        assert torch.equal(kv_layers(p)[0][0], k) and torch.equal(kv_layers(p)[0][1], v)
    assert list(joint) == [t[:len(t) - len(x)] for t, x in zip(lone, tails)]


def test_prompts_made_lazily_stack_as_the_tokenizer_encodes_them(model):
    """A run_batch program's prompt (``state/deferred.prompt``) tokenized when read, alone or with others stacked:
    each row is the tokenizer's own encoding of its prompt; an unencodable prompt is refused at once."""
    from continuum.errors import UnencodableTextError
    from continuum.state import deferred

    prompts = ["Once upon a time there was", "The dog", "Le café 東京 🤗", "A"]
    want = [model.tokenizer.hf(p)["input_ids"] for p in prompts]
    lazy = [deferred.prompt(model, p) for p in prompts]
    stacked = SequenceState.stack(lazy)
    assert [ids for ids, _ in stacked._real_rows()] == want and stacked.cached_tokens.tolist() == [[0]] * 4
    assert list(stacked) == list(SequenceState.from_prompts(model, prompts))
    alone = deferred.prompt(model, prompts[2])
    assert alone._ids[alone._mask.bool()].tolist() == want[2] and list(alone) == [prompts[2]]
    mixed = SequenceState.stack([lazy[0], SequenceState.from_prompts(model, prompts[1]), lazy[2]])
    assert [ids for ids, _ in mixed._real_rows()] == [want[0], want[1], want[2]]
    with pytest.raises(UnencodableTextError):
        deferred.prompt(model, "a \ud800 b")


def _rows_of(state) -> list:
    """Each row's real tokens and log-probs, NaN written as None (NaN != NaN)."""
    return [(ids, [None if x != x else x for x in lps]) for ids, lps in state._real_rows()]


def _assert_stacked_as_they_were(parts: list) -> None:
    stacked = SequenceState.stack(parts)
    from continuum.models import kv

    C = max(kv.length(p._kv) for p in parts)  # (cached columns, padding included)
    rows = [(p, r) for p in parts for r in range(p.batch)]
    assert stacked.batch == len(rows) and kv_layers(stacked)[0][0].shape[2] == C
    for i, (p, r) in enumerate(rows):
        c, n = kv.length(p._kv), p._ids.shape[1]
        mine = p._mask[r].bool()
        got = stacked._mask[i].bool()
        assert stacked._ids[i][got].tolist() == p._ids[r][mine].tolist()
        assert stacked._ids[i, C - c:C].tolist() == p._ids[r, :c].tolist()  # cached columns end at C
        assert stacked._ids[i, stacked._ids.shape[1] - (n - c):].tolist() == p._ids[r, c:].tolist()  # the suffix last
        for (k, v), (k0, v0) in zip(kv_layers(stacked), kv_layers(p) or [(None, None)] * len(kv_layers(stacked))):
            if c:
                assert torch.equal(k[i, :, C - c:], k0[r]) and torch.equal(v[i, :, C - c:], v0[r])
            assert not k[i, :, :C - c].any() and not v[i, :, :C - c].any()
    assert_reuse_exact(stacked)


# ---------------------------------------------------------------- views
def test_repr_and_str(model):
    s = greedy_c(model)(PROMPTS, max_tokens=2)
    r = repr(s)
    assert "batch=3" in r and "samples=1" in r and "cached=" in r
    assert str(s).count("\n") == 2
    assert len(s) == 3 and list(s) == s.texts


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 40])
def test_real_rows_of_many_rows_equal_a_per_row_listing(rows):
    """A state's real rows (many rows: one boolean gather, cut per row) against a brute-force listing of every row's
    masked-in ids and log-probs, holes and empty rows included."""
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, 1000, (rows, 13), generator=g)
    mask = (torch.rand((rows, 13), generator=g) > 0.3).long()
    mask[0] = 0  # an empty row
    lp = torch.randn((rows, 13), generator=g)
    lp[:, ::3] = float("nan")  # prompt tokens' log-probs
    state = SequenceState(model=None, ids=ids, mask=mask, logprobs=lp, weights=torch.zeros(rows), kv=None, batch=rows,
                          samples=1)
    want = [([int(t) for t, m in zip(ids[r], mask[r]) if m], [float(x) for x, m in zip(lp[r], mask[r]) if m])
            for r in range(rows)]
    got = state._real_rows()
    assert [i for i, _ in got] == [i for i, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))
