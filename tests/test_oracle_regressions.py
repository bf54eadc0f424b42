"""The oracle's regressions (``tests/test_oracle.py``): each bug its histories (or the stress driver,
``tests/test_oracle_stress.py``) found, as the short history that hit it, checked against the backend's own reference."""

from __future__ import annotations

import pytest
import torch
from oracle_backends import gguf_path, hf_backend, llama_backend, own_llama
from oracle_checks import check_choice, check_greedy, check_state, option_scores, real_rows
from oracle_support import (
    OPTIONS,
    Call,
    Held,
    _one_thread,  # noqa: F401  (autouse: one intra-op thread for this module)
    cut_carried,
    execute,
    gather,
    longest,
    prepare,
    verify,
)

from continuum import SequenceState, continuous, generate, samplers

from conftest import chars_key


@pytest.mark.parametrize("backend", ["stories", "stories-prefix", "gguf", "gguf-invariant"])
def test_choice_same_state_twice_regression(backend):
    """Issue 56: a greedy choice took a worse option depending on what ran before; the same state picked twice got
    two answers. 12 items x 3 rounds of text -> `` ok?`` -> choice, each choice against the reference's argmax."""
    if backend.startswith("gguf"):
        pytest.importorskip("llama_cpp")
    b = hf_backend("stories") if backend.startswith("stories") else llama_backend(backend.endswith("invariant"), False, False)
    model = b.variants["prefix" if backend.endswith("prefix") else "plain"]
    text = continuous(generate.text(model, samplers.greedy()))
    pick = continuous(generate.choice(model, [" yes", " no"]))
    answers: dict[tuple, set] = {}
    for _ in range(3):
        for x in range(12):
            s = text(f"item {x}: once upon a time", max_tokens=6) + " ok?"
            c = pick(s)
            check_choice(b, s, c, [" yes", " no"])
            answers.setdefault(tuple(real_rows(s)[0][0]), set()).add(c.value)
    assert all(len(v) == 1 for v in answers.values()), answers


# (found by the oracle, fixed in state/convert.py: a state of one LlamaCpp continued on another instance of the same
# GGUF (same fingerprint) raised BackendError 'a KV view of another llama.cpp model (or pool)'; it is recomputed there)
def test_llamacpp_state_on_another_instance_of_the_same_gguf_regression():
    pytest.importorskip("llama_cpp")
    a, other = llama_backend(False, False, False), llama_backend(False, True, False)
    s = continuous(generate.text(a.model, samplers.greedy()))("Once upon a time", max_tokens=6) + " The dog"
    out = continuous(generate.text(other.model, samplers.greedy()))(s, max_tokens=6)
    n = len(real_rows(s)[0][0])
    check_state(a, out, [0.0])
    check_greedy(a, out, [n], [real_rows(s)[0][0]])


def test_oracle_fails_on_a_wrong_choice():
    """The oracle can fail: a choice whose row holds the reference's worse option is refused."""
    b = hf_backend("stories")
    s = SequenceState.from_prompts(b.model, "Once upon a time, there was a little girl named Lily. She was very")
    _, scores = option_scores(b, s, [" happy", " xylophone"])
    assert scores[0][0] - scores[0][1] > 1e-3
    wrong = continuous(generate.choice(b.model, [" xylophone"]))(s)
    with pytest.raises(AssertionError, match="reference's best"):
        check_choice(b, s, wrong, [" happy", " xylophone"])


# (found by the oracle, fixed in models/llamacpp/decode.py and tree.py: on a 256-cell pool, a held state generated to
# the context fills the pool; continuing a cut of it (a choice, or text) raised KVCacheFullError 'no free KV cell for
# 3 new tokens': the held state was pinned as the fork's source, though the fork alone reads its cells; now the rest of
# it is spilled. Both modes, text too: tests/test_llamacpp_pool.py)
def test_continue_a_cut_of_a_pool_filling_state_regression():
    b = own_llama(256)  # (a pool of its own: this one ends full)
    m = b.model
    s = continuous(generate.text(m, samplers.greedy()))("Once upon a time", max_tokens=None)
    assert s.finish_reasons == [["context"]] and len(real_rows(s)[0][0]) == m.llama.n_ctx  # every cell
    cut = s[..., :60] + " ok?"
    out = continuous(generate.choice(m, list(OPTIONS[1])))(cut)
    check_state(b, out, [0.0])
    check_choice(b, cut, out, list(OPTIONS[1]))


# (found by the oracle, fixed in models/llamacpp/window.trim: the cells of a dropped state were not given back while an
# earlier state of its line was held (a 2-row state generated to the context on a 1024-cell pool, dropped: 1023 cells
# still in use; continuing the ancestor raised KVCacheFullError): a sequence's tail is now cut when the longest view
# reaching it is dropped. Both modes: tests/test_llamacpp_pool.py)
def test_cells_of_a_dropped_state_come_back_regression():
    import gc

    b = own_llama(1024)  # (a pool of its own)
    text = continuous(generate.text(b.model, samplers.greedy()))
    a = text(["Once upon a time", "The cat"], max_tokens=3)
    held = text(a, max_tokens=2)  # (without this state in between, the cells come back)
    full = text(held + ".", max_tokens=None)
    assert full.finish_reasons == [["context"], ["context"]]  # 2 x 512 tokens: every cell
    del full
    gc.collect()
    out = text(a, max_tokens=2)
    check_state(b, out, [0.0, 0.0])
    check_greedy(b, out, [len(ids) for ids, _ in real_rows(a)], [ids for ids, _ in real_rows(a)])


# (found by the oracle, fixed in loop/decoding.py (turns.apart): on a 256-cell llama.cpp pool one call of 2 rows
# without max_tokens (greedy to the context: 2 x 256 positions) raised KVCacheFullError 'no free KV cell for 2 new
# tokens' once its rows outgrew the pool together, though each row alone fits: a call alone cannot be parked, and only
# calls with max_tokens are split by cells up front. Its rows now run again as parts, the engine parking what does not fit)
def test_a_call_of_two_rows_to_the_context_of_a_small_pool_regression():
    b = own_llama(256)  # (a pool of its own)
    s = SequenceState.from_prompts(b.model, ["Once upon a time"] * 2)
    out = continuous(generate.text(b.model, samplers.greedy()))(s, max_tokens=None)
    assert out.finish_reasons == [["context"], ["context"]]
    check_state(b, out, [0.0, 0.0])
    check_greedy(b, out, [len(ids) for ids, _ in real_rows(s)], [ids for ids, _ in real_rows(s)])
    one = SequenceState.from_prompts(b.model, "Once upon a time")  # a prompt's independent samples: the same
    seeded = torch.Generator().manual_seed(0)
    forks = continuous(generate.text(b.model, samplers.multinomial(2)))(one, max_tokens=None, rng=seeded)
    assert forks.finish_reasons == [["context", "context"]]
    check_state(b, forks, [0.0, 0.0])
    assert list(s) == ["Once upon a time"] * 2  # (the input, untouched)


def empty_row(backend: str):
    """A BOS-only state (``state[..., :0]``) on stories260K: transformers or the f32 GGUF."""
    b = hf_backend("stories") if backend == "stories" else llama_backend(False, False, False)
    return b, SequenceState.from_prompts(b.model, "Once upon a time")[..., :0]


# (found by the oracle, fixed in loop/scoring.py: at the start of an empty (BOS-only) row on the stories260K
# SentencePiece vocabulary a choice over [' yes', ' no'] scored and appended the options without their leading space,
# ids [1, 297, 414], value 'no', where state + ' no' is [1, 410, 297, 414], text ' no')
@pytest.mark.parametrize("backend", ["stories", "gguf"])
def test_choice_at_the_start_of_an_empty_row_regression(backend):
    b, empty = empty_row(backend)
    c = continuous(generate.choice(b.model, [" yes", " no"]))(empty)
    assert c.value in [" yes", " no"]
    check_choice(b, empty, c, [" yes", " no"])


# (found by the oracle, fixed in loop/decoding.py (state/combine.lead_space): at the start of an empty (BOS-only) row
# on the stories260K vocabulary a regex ' [0-9]{1,3}' step's tokens spelled ' 200' ([410, 479, 477, 477], 410 the
# space piece) but its value and text read '200': SentencePiece's decoder drops a row's first leading space)
@pytest.mark.parametrize("backend", ["stories", "gguf"])
def test_regex_at_the_start_of_an_empty_row_regression(backend):
    import re

    b, empty = empty_row(backend)
    r = continuous(generate.regex(b.model, r" [0-9]{1,3}"))(empty, max_tokens=10)
    check_state(b, r, [0.0])
    assert re.fullmatch(r" [0-9]{1,3}", r.value), r.value


# (found by the oracle, timing-dependent, fixed in models/llamacpp/backend.py: asyncio.gather of text, forks, beams and
# choices on a 256-cell pool while earlier states are held failed with KVCacheFullError ('no room to restore a spilled
# state of 57 tokens'): a choice's token tree decoded in the same step as a call's new forks made room by spilling
# them (not yet held), and their restore apart no longer fit. Now a step holds what it decoded; the deterministic
# variant: tests/test_llamacpp_pool.py::test_a_step_keeps_the_forks_it_made_resident_while_a_token_tree_makes_room)
@pytest.mark.parametrize("invariant", [False, True])
def test_concurrent_calls_on_a_small_pool_regression(invariant):
    import random

    b = own_llama(256, invariant)
    calls = [Call("greedy", k=6), Call("fork", n=3, k=4, seed=1), Call("beam", n=3, k=4), Call("choice", arg=OPTIONS[1])]
    first, inp = Call("greedy", k=40), SequenceState.from_prompts(b.model, ["Once upon a time", "The cat"])
    rnd, held = random.Random(0), [verify(b, first, inp, [0.0, 0.0], execute(b, first, inp))]
    for _ in range(60):
        jobs = [(c, *prepare(h, c)) for h, c in zip(rnd.choices(held, k=3), rnd.choices(calls, k=3))]
        held += [h for h in gather(b, jobs) if longest(h.state) < 120]


def test_continue_a_cut_of_a_fork_merged_with_another_call_regression():
    b = hf_backend("tiny")
    s0 = SequenceState.from_prompts(b.model, ["Once upon a time"] * 2)
    fork, sample = Call("fork", n=3, k=4, seed=0), Call("sample", k=1, seed=0)
    for _ in range(3):
        s1, _ = gather(b, [(fork, s0, [0.0, 0.0]), (Call("greedy", k=2), s0, [0.0, 0.0])])
        cut = s1.state[:, :, :26]
        verify(b, sample, cut, cut_carried(s1.state, cut, s1.carried), execute(b, sample, cut))


# (found by the long oracle, gguf profile, a 1,024-cell pool with the prefix cache on: three unbounded greedy acalls
# gathered; at position 361 of a 512-token text the reference's top-2 gap is 0.078 and continuum took the second.
# Not a wrong cache: every K value of the row's cells is within one f16 step of llama-cpp-python's prefill, as are
# those of llama-cpp-python's own one-token-at-a-time evaluation, which moves that gap to 0.040. The margin compared
# was DECODE_TOL, where each of the two logits may move by DECODE_TOL (docs/llamacpp.md#exactness): now twice it.)
def test_greedy_margin_regression():
    b = llama_backend(False, False, True)
    h0 = Held(SequenceState.from_prompts(b.model, ["Lily saw a big dog."]), [0.0])
    first = [Call("json", k=12, arg="small"), Call("choice", arg=(" yes", " no"), suffix=" ok?")]
    h1, h2 = gather(b, [(c, *prepare(h0, c)) for c in first])
    greedy = [Call("greedy", k=None), Call("greedy", k=None), Call("greedy", k=None, suffix=".")]
    out = gather(b, [(c, *prepare(h, c)) for h, c in zip([h2, h2, h1], greedy)])
    assert [len(real_rows(h.state)[0][0]) for h in out] == [512] * 3  # (to the context: the long texts it was found on)


# (found by the stress driver, tests/test_oracle_stress.py, stories GGUF on a 256-cell pool: a choice on two rows, a
# 57-token view of a spilled 134-token state beside a 62-token view of a resident 135-token one, failed with
# KVCacheFullError 'no room to restore a spilled state of 134 tokens': the token tree restored the whole spilled
# sequence where a decode forks only the view's positions from its bytes (window.fork_spilled). Now the tree does too.)
def test_a_choice_on_a_short_view_of_a_long_spilled_state_restores_only_the_view_regression():
    b = own_llama(256)
    greedy = Call("greedy", k=140)
    longer = verify(b, greedy, inp := SequenceState.from_prompts(b.model, "Once upon a time"), [0.0],
                    execute(b, greedy, inp))
    short = longer.state[chars_key(longer.state, slice(None, 30))]
    assert b.model.pool.spill_idle() >= 1 and longer.state._kv.views[0].seq.id is None
    other = verify(b, greedy, inp := SequenceState.from_prompts(b.model, "The cat sat on the mat"), [0.0],
                   execute(b, greedy, inp))
    cut = other.state[chars_key(other.state, slice(None, 40))]
    both = SequenceState.stack([short, cut])
    assert longest(longer.state) + longest(other.state) > 256  # (both sequences whole do not fit the pool)
    choice = Call("choice", arg=OPTIONS[0])
    verify(b, choice, both, [0.0, 0.0], execute(b, choice, both))


# (found by the stress driver on the LFM2 GGUF, a 256-cell pool: a run_batch program's greedy call on two rows, 65-
# and 58-token views of spilled 146- and 139-token states, was refused 'no room to restore a spilled state of 139
# tokens'. A hybrid's bytes cannot be cut (its recurrent summary is at their end), so each row restores its whole
# sequence, 285 cells together; the call's rows were priced at their 78-token width and not split. Now a row is priced
# at least at what its sequence takes resident (model.row_cells, loop/turns.py): the rows run as parts.)
def test_short_views_of_long_spilled_hybrid_states_run_apart_regression():
    pytest.importorskip("llama_cpp")
    gguf_path("lfm2")
    b = own_llama(256, kind="lfm2")
    first, then, cuts, longs = Call("greedy", k=60), Call("greedy", k=70), [], []
    for prompt in ("Once upon a time", "The cat sat on the mat"):
        inp = SequenceState.from_prompts(b.model, prompt)
        cuts.append(verify(b, first, inp, [0.0], execute(b, first, inp)).state)  # (a snapshot where it ends)
        longs.append(verify(b, then, cuts[-1], [0.0], execute(b, then, cuts[-1])))  # (its sequence extended)
        b.model.pool.spill_idle()
    assert sum(longest(h.state) for h in longs) > 256 and all(c._kv.views[0].seq.id is None for c in cuts)
    both, more = SequenceState.stack(cuts), Call("greedy", k=12)
    verify(b, more, both, [0.0, 0.0], execute(b, more, both))


# (found by the stress driver on the LFM2 GGUF, 256 cells: three samples of one state, spilled, continued together:
# a hybrid's fork family restores apart, each member its own copy of their common prefix (reshare cannot share a
# recurrent sequence's cells), 3 x 93 cells, refused 'no room to restore a spilled state of 93 tokens'. A call refused
# for room running alone now computes such rows from their tokens instead (setup.recompute_costly), their common
# prefix decoded once: 60 + 3 x 33 cells.)
def test_a_spilled_hybrid_fork_family_is_recomputed_not_refused_regression():
    pytest.importorskip("llama_cpp")
    gguf_path("lfm2")
    b = own_llama(256, kind="lfm2")
    inp = SequenceState.from_prompts(b.model, "Once upon a time, there was a little girl named Lily. " * 3)
    fork = Call("fork", n=3, k=40, seed=3)
    fam = verify(b, fork, inp, [0.0], execute(b, fork, inp))
    b.model.pool.spill_idle()
    assert 3 * longest(fam.state) > 256 and all(v.seq.id is None for v in fam.state._kv.views)
    more = Call("sample", k=3, seed=5)
    verify(b, more, fam.state, fam.carried, execute(b, more, fam.state))


# (found by the stress driver on the LFM2 GGUF, 256 cells: a 3-sample state continued by multinomial(3) needed its
# shared prefix and 3 x (own tokens + new) cells, more than the pool; a fresh draw's samples were split into seeded
# groups, a state's own were not, and the call was refused as 'a prompt that cannot fit alone'. Splitting them needed
# the family's true cells (model.rows_cells: the fork's shared prefix once): priced by the sum of their tokens,
# families that fit were split too and their seeded draws changed.)
# (Its first version sliced a 2-prompt state's rows as state[b:b + 1, :], a SlicingError on samples > 1: the stress
# driver, seed 61, history 39.)
@pytest.mark.parametrize("prompts", [1, 2])
def test_a_state_s_own_samples_that_cannot_continue_together_run_in_groups_regression(prompts):
    pytest.importorskip("llama_cpp")
    gguf_path("lfm2")
    b = own_llama(256, kind="lfm2")
    fams, carried = [], []
    for text in ["Once upon a time, there was a little girl named Lily. ", "The cat sat on the mat and looked out. "][:prompts]:
        inp = SequenceState.from_prompts(b.model, text * 2)
        fork = Call("fork", n=3, k=60, seed=3)
        fam = verify(b, fork, inp, [0.0], execute(b, fork, inp))
        shared = longest(inp)
        assert shared + 3 * (longest(fam.state) - shared) <= 256 < shared + 3 * (longest(fam.state) - shared + 26)
        fams.append(fam.state)
        carried += fam.carried
    both, more = SequenceState.stack(fams), Call("sample", k=26, seed=5)
    verify(b, more, both, carried, execute(b, more, both))


# (found by the stress driver on the window-8 GGUF, 256 cells, seed 7, history 1: six samples of two prompts, spilled,
# continued by one call, were priced with each prompt's common prefix once (model.rows_cells) and fitted; restored, a
# member shared that prefix with a resident relative only from 16 positions on (reshare.MIN_CELLS), and theirs were
# 12-13: restored apart they outgrew the pool mid-call, 'no free KV cell for 6 new tokens'. Any common prefix is
# shared now, as the price assumes.)
@pytest.mark.parametrize("kind", ["f32", "window"])
def test_a_spilled_fork_family_with_a_short_common_prefix_is_restored_shared_regression(kind):
    pytest.importorskip("llama_cpp")
    b = own_llama(256, kind=kind)
    fams, carried = [], []
    for text in ["Once upon a time", "The cat sat"]:
        inp = SequenceState.from_prompts(b.model, text)
        fork = Call("fork", n=3, k=30, seed=11)
        fam = verify(b, fork, inp, [0.0], execute(b, fork, inp))
        fams.append((longest(inp), fam.state))
        carried += fam.carried
    both, more = SequenceState.stack([f for _, f in fams]), Call("sample", k=10, seed=5)
    shared = sum(p + 3 * (longest(f) - p) for p, f in fams)  # (what the call is priced at: each prefix once)
    apart = sum(3 * longest(f) for _, f in fams)
    assert max(p for p, _ in fams) < 16 and shared + 6 * 10 <= 256 < apart + 6 * 10
    b.model.pool.spill_idle()
    assert all(v.seq.id is None for v in both._kv.views)
    verify(b, more, both, carried, execute(b, more, both))
