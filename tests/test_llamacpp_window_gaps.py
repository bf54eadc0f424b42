"""A sliding window's cells given away behind a sequence's end are recomputed, never read over (issue 56; a tiny
Gemma 3 with a window of 8: tests/tiny_gguf.py; models/llamacpp/window.py, gaps.py, reshare.py).

llama.cpp hands a sliding-window cell to new tokens once it lies outside the window behind its one sequence's END,
though a view behind that end still reads it; the long oracle found log-probs off by up to 26 nats on this model
(views continued over the gaps). Reference: llama-cpp-python's own evaluation of the result's ids
(tests/oracle_checks.py). Gemma 3 270M's own window: tests/test_llamacpp_window_recompute.py.
"""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("llama_cpp")

from continuum import continuous, generate, samplers

pytestmark = pytest.mark.slow


# Here the gaps are made directly (the cells of a few positions inside a view's window removed).
@pytest.fixture(scope="module")
def window():
    from oracle_backends import own_llama

    return own_llama(1024, kind="window")


def _gap(b, state, lo: int, hi: int) -> None:
    """Positions ``[lo, hi)`` of ``state``'s sequence gone from llama.cpp's cells, as a reuse leaves them."""
    from continuum.models.llamacpp._lib import lib

    m = b.model
    with m.llama.lock:
        lib().llama_memory_seq_rm(m.llama.memory, state._kv.views[0].seq.id, lo, hi)


def test_a_view_whose_window_has_gaps_is_recomputed_not_extended_over_them(window):
    from oracle_checks import check_state, real_rows

    from continuum import SequenceState

    from conftest import chars_key

    gen = window.generator("plain", "greedy")
    s = gen(SequenceState.from_prompts(window.model, "Once upon a time"), max_tokens=40)
    cut = s[chars_key(s, slice(None, 40))]
    n = cut._kv.views[0].n_tokens
    assert 12 < n < s._kv.views[0].n_tokens - 8  # (behind the end by more than a window)
    _gap(window, s, n - 5, n - 3)  # (inside the window behind n; the sequence's lowest cell stays)
    before = window.model.tokens_computed
    out = gen(cut + " and", max_tokens=6)
    assert window.model.tokens_computed - before > len(real_rows(cut)[0][0]) - n  # (the row computed again)
    check_state(window, out, [0.0])


def test_the_window_probe_reads_as_llama_cpps_bytes_before_and_after_a_gap(window):
    """``gaps.held`` (byte counts compared) against the positions llama.cpp's own bytes hold (``bytes_hold``), for a
    view behind its sequence's end, before and after two of its window cells go: both True, then both False. The
    oracle checks the same after every step of every history (``check_window_probes``)."""
    from continuum import SequenceState
    from continuum.models.llamacpp import gaps

    from conftest import chars_key
    from llamacpp_support import bytes_hold, check_window_probes

    gen = window.generator("plain", "greedy")
    s = gen(SequenceState.from_prompts(window.model, "Tom and Sue went to the"), max_tokens=40)
    cut = s[chars_key(s, slice(None, 40))]
    n, seq = cut._kv.views[0].n_tokens, s._kv.views[0].seq
    pool, lo = window.model.pool, max(0, n - window.model.llama.n_swa + 1)
    assert 12 < n < seq.extent - 8 and n in seq.holders
    with window.model.llama.lock:
        assert gaps.held(pool, seq.id, lo, n) and bytes_hold(pool, seq.id, lo, n)
    assert check_window_probes(pool) >= 2  # (the view's window, and the one behind the end)
    _gap(window, s, n - 5, n - 3)
    with window.model.llama.lock:
        assert not bytes_hold(pool, seq.id, lo, n), "the reference sees the gap"
        assert not gaps.held(pool, seq.id, lo, n)
        assert gaps.held(pool, seq.id, n - 3, n) and bytes_hold(pool, seq.id, n - 3, n)  # (above the gap: whole)
    check_window_probes(pool)


def test_a_sequence_cut_back_over_gaps_is_recomputed(window):
    """A view behind the end stays while the longer one goes: the sequence is cut back to the view (``window.trim``),
    whose window is then the one behind the end, which a later decode no longer probes."""

    from oracle_checks import check_state

    from continuum import SequenceState

    from conftest import chars_key

    gen = window.generator("plain", "greedy")
    s = gen(SequenceState.from_prompts(window.model, "Lily saw a big dog."), max_tokens=40)
    cut = s[chars_key(s, slice(None, 40))]
    n = cut._kv.views[0].n_tokens
    _gap(window, s, n - 5, n - 3)
    del s
    gc.collect()
    check_state(window, gen(cut, max_tokens=6), [0.0])


def test_a_view_behind_its_end_among_other_cells_is_found_whole_and_reused(window):
    """The probe's other side: two rows generated together (their cells interleaved), each cut behind its end, are
    continued on their own cells (only the new tokens computed) and exactly."""
    from oracle_checks import check_state

    from continuum import SequenceState

    from conftest import chars_key

    gen = window.generator("plain", "greedy")
    two = gen(SequenceState.from_prompts(window.model, ["Once upon a time", "The cat sat on"]), max_tokens=40)
    cut = two[chars_key(two, slice(None, 40))]
    before = window.model.tokens_computed
    out = gen(cut, max_tokens=5)
    assert window.model.tokens_computed - before == 2 * 5
    check_state(window, out, [0.0, 0.0])


def test_a_short_view_of_a_spilled_window_long_sequence_is_not_forked_from_bytes_without_its_window():
    """A sequence of exactly ``n_swa`` positions: llama.cpp's ``find_slot`` may give its position 0's window cell
    (masked behind its end) to new tokens, so its spilled bytes lack it, and a short view forked from those bytes cut
    short (``window.fork_spilled``) was extended without it (the stress driver: a log-prob 14 nats off). Now the
    bytes are read first (``window.holds``): the view is recomputed. Failed before (the first check)."""

    from oracle_backends import own_llama
    from oracle_checks import check_state, real_rows

    from continuum import SequenceState
    from continuum.models.llamacpp._lib import lib

    from conftest import chars_key

    b = own_llama(256, kind="window")  # (a fresh pool: where find_slot puts cells is known)
    gen, m = b.generator("plain", "greedy"), b.model
    x = gen(SequenceState.from_prompts(m, "The"), max_tokens=1)  # (cells 0..1)
    p = SequenceState.from_prompts(m, "Lily saw a big dog.")
    s = gen(p, max_tokens=9 - len(real_rows(p)[0][0]))  # (its KV: every token but the last, cells 2..9)
    seq = s._kv.views[0].seq
    assert s._kv.views[0].n_tokens == m.llama.n_swa == 8
    short = s[chars_key(s, slice(None, 2))]
    assert short._kv.views[0].n_tokens < 8
    del x
    gc.collect()  # (its cells freed: llama.cpp's search for free cells starts at 0 again)
    w = gen(SequenceState.from_prompts(m, "The cat sat on the mat"), max_tokens=1)  # cells 0, 1, then s's masked one
    assert int(lib().llama_memory_seq_pos_min(m.llama.memory, seq.id)) == 1  # (position 0's window cell given away)
    assert m.pool.spill_idle() >= 1 and seq.id is None
    check_state(b, gen(short + " She was", max_tokens=6), [0.0])
    check_state(b, gen(s, max_tokens=3), [0.0])
    del w


def test_a_choice_row_probed_before_another_row_s_restore_is_probed_again():
    """A token tree (choice scoring) probed each row's window, then restored the next row's spilled sequence, whose
    cells llama.cpp may take from the window behind an earlier row's sequence end (masked there, though the earlier
    row's view behind that end still reads them): the earlier row was scored over the gaps, silently (the stress
    driver: -40.4 where llama.cpp gives -32.6). Now every restore comes before every probe, and the row is computed
    again. Here the restore is made to take them: a freed cell sends llama.cpp's search back to 0, then to row 0's
    oldest (masked) window cells; a restored window cache holds the 8 cells behind its end. Failed before (row 0's
    option token: -27.6 where llama.cpp gives -12.5)."""

    from oracle_backends import own_llama
    from oracle_checks import check_choice, check_state

    from continuum import SequenceState
    from continuum.models.llamacpp._lib import lib

    from conftest import chars_key

    b = own_llama(256, kind="window")  # (a fresh pool: where find_slot puts cells is known)
    gen, m = b.generator("plain", "greedy"), b.model
    x = gen(SequenceState.from_prompts(m, "The"), max_tokens=1)  # (cells 0..1)
    s = gen(SequenceState.from_prompts(m, "Once upon a time"), max_tokens=40)  # (the cells after them)
    cut = next(c for c in (s[chars_key(s, slice(None, k))] for k in range(20, 40)) if c._kv.views[0].n_tokens >= 10)
    n, seq = cut._kv.views[0].n_tokens, s._kv.views[0].seq
    assert 10 <= n <= 12 and n < seq.extent - 8  # (behind its sequence's end by more than the window)
    other = gen(SequenceState.from_prompts(m, "Lily saw a big dog. The cat sat on the mat."), max_tokens=20)
    with m.llama.lock:
        m.pool.spill(other._kv.views[0].seq)  # (only it: the cut's sequence stays resident)
    del x
    gc.collect()  # (llama.cpp's search for free cells starts at 0 again: x's 2 cells, then s's positions 0..5)
    both = SequenceState.stack([cut, other])
    options = [" ok", " and then"]
    out = b.generator("plain", "choice", arg=tuple(options))(both)
    assert int(lib().llama_memory_seq_pos_min(m.llama.memory, seq.id)) > n - m.llama.n_swa  # (the restore took them)
    check_state(b, out, [0.0, 0.0])
    check_choice(b, both, out, options)


def test_a_member_restored_beside_a_sibling_whose_window_moved_on_shares_the_prefix_below_it():
    """Two samples of one 40-token state; one continued 60 tokens (its window moved on: its window cache no longer
    holds the positions its sibling's next decode reads), the other spilled. Restored, the sibling shares the prefix
    below its window with the continued one (``reshare._below_window``), its own cells only the window (8): it was
    restored whole before (42 cells; the stress driver's refusal on a 256-cell pool). Failed before (42 > 10). Its
    continuation is what llama.cpp gives, and so is the continued sample's afterwards."""

    import torch
    from oracle_backends import own_llama
    from oracle_checks import check_state

    from continuum import SequenceState
    from continuum.models.llamacpp import cells
    from continuum.models.llamacpp._lib import lib

    b = own_llama(256, kind="window")  # (a fresh pool: where find_slot puts cells is known)
    m = b.model
    n_swa = m.llama.n_swa
    x = b.generator("plain", "greedy")(SequenceState.from_prompts(m, "The"), max_tokens=1)  # (cells 0..1)
    p = SequenceState.from_prompts(m, "Once upon a time there was a little girl named Lily")
    base = b.generator("plain", "greedy")(p, max_tokens=40 - p.token_ids.shape[1])
    pair = continuous(generate.text(m, samplers.multinomial(2)))(base, max_tokens=2, rng=torch.Generator().manual_seed(3))
    a, c = pair[:, 0, :], pair[:, 1, :]
    seq_c = c._kv.views[0].seq
    with m.pool.model.lock:
        m.pool.spill(seq_c)  # (then a's cells are its own: llama.cpp may give the masked ones of its window away)
    assert seq_c.id is None
    del x
    gc.collect()  # (its cells freed: llama.cpp's search for free cells starts at 0 again, then a's masked ones)
    a2 = b.generator("plain", "greedy")(a, max_tokens=60)  # (a's row decodes on: its window moves past c's)
    need = seq_c.extent - n_swa + 1  # (the first position c's next decode reads through its window)
    assert int(lib().llama_memory_seq_pos_min(m.llama.memory, a2._kv.views[0].seq.id)) > need  # (a's moved past it)
    used = cells.used(m.pool)
    out = b.generator("plain", "greedy")(c, max_tokens=1)
    grown = cells.used(m.pool) - used
    assert grown <= n_swa + 2, grown  # (its window and the new token, not its 41 positions again)
    check_state(b, out, [None])
    check_state(b, b.generator("plain", "greedy")(a2, max_tokens=3), [None])


def test_a_row_whose_window_a_failed_decode_gave_away_is_not_decoded_over_the_gaps():
    """A decode runs in chunks; an earlier chunk's tokens move a row's end on, so the window cells behind its old
    end are masked there and free to a later chunk's tokens (llama.cpp's ``find_slot``). When a later chunk then
    finds no free cell, the decode undoes its cells and, after spilling idle sequences, ran again: the row was
    decoded over the gaps, silently (the long oracle, window-8 GGUF: an option's log-prob 4 nats off, about one run
    in eight). Now such rows raise :class:`StaleWindowError` (their callers recompute them). Here: a sequence whose
    cells the pool's count misses (what the retry after a failed decode exists for) makes room only once spilled;
    the row extends a 10-token state by 100 tokens, ten one-token rows take its old window cells, and a last row
    finds no room. Failed before (the row's log-probs up to 31.7 nats off llama.cpp's evaluation)."""
    import numpy as np
    import torch
    from oracle_backends import own_llama

    from continuum.errors import StaleWindowError
    from continuum.models.llamacpp._lib import lib
    from continuum.models.llamacpp.decode import DecodeRow, decode
    from continuum.models.llamacpp.sequences import KVView

    b = own_llama(256, kind="window")  # (a fresh pool: where find_slot puts cells is known)
    m, L = b.model, lib()
    pool, model = m.pool, m.llama
    V = model.n_vocab
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(3, V, n).tolist()  # noqa: E731
    with model.lock:  # 30 cells the pool does not count (cells 0..29): decoded into its sequence behind its back
        hidden = pool.new_seq()
        held = KVView(pool, hidden, 0)
        batch = L.llama_batch_init(30, 0, 1)
        for i, t in enumerate(ids(30)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 0
            batch.seq_id[i][0] = hidden.id
        batch.n_tokens = 30
        assert L.llama_decode(model.ctx, batch) == 0
        L.llama_batch_free(batch)
    x = decode(pool, [DecodeRow(pool.empty(), ids(100), "none")]).views[0]  # (cells 30..129)
    s_ids = ids(10)
    s = decode(pool, [DecodeRow(pool.empty(), s_ids, "none")]).views[0]  # (cells 130..139)
    x.release()  # (llama.cpp's search for free cells goes back to cell 30)
    new = ids(100)
    rows = [DecodeRow(s, new, "all")] + [DecodeRow(pool.empty(), ids(1), "none") for _ in range(10)]
    rows.append(DecodeRow(pool.empty(), ids(120), "none"))  # (30 + 10 + 100 + 10 + 120 > 256 cells: no room)
    try:
        out = decode(pool, rows)
    except StaleWindowError as exc:
        assert exc.rows == [0]
        assert not pool.can_extend(s)  # (its window is gone: the caller recomputes it, never extends it)
    else:  # never over the gaps: llama.cpp's own evaluation of the ids
        got = torch.from_numpy(out.row(0)).double().log_softmax(-1)
        ref = b.logprobs(s_ids + new)[len(s_ids):]
        err = (got - ref).abs().max().item()
        assert err <= b.tol, f"row 0 decoded over its missing window cells: log-probs off by {err:.2f}"
    del held


def test_a_call_whose_rows_keep_losing_their_windows_to_other_calls_is_computed_again_not_refused(window, monkeypatch):
    """Concurrent calls: another call's decode may take the window cells behind a row's end (a view behind its
    sequence's end) after this call's setup found them whole. The call reruns with the rows found stale computed
    again; it was refused after three such reruns, each losing another row (the long oracle, window-8 GGUF, three
    concurrent calls: ``StaleWindowError`` about one run in ten). Found stale twice, a call now computes every row
    again: rows of its own sequences, which no other call extends. Here each token tree (choice scoring) first loses a
    cached row's cells, as the other call's decode leaves them. Failed before (``StaleWindowError``)."""
    from oracle_checks import check_choice, check_state

    from continuum import SequenceState
    from continuum.models.llamacpp import tree
    from continuum.models.llamacpp._lib import lib

    from conftest import chars_key

    gen = window.generator("plain", "greedy")
    prompts = ["Once upon a time", "The cat sat on", "Lily saw a big dog.", "Tom had a red ball"]
    s = gen(SequenceState.from_prompts(window.model, prompts), max_tokens=40)
    cut = s[chars_key(s, slice(None, 40))]
    assert all(8 < v.n_tokens < v.seq.extent - 8 for v in cut._kv.views)  # (each behind its end by a window)
    m, taken, fork_leaves = window.model, set(), tree._fork_leaves

    def racing(pool, rows):  # (under the model's lock, as any decode of another call)
        for row in rows:
            v = row.view
            if v.seq is not None and v.seq.id is not None and v.n_tokens < v.seq.extent and id(v.seq) not in taken:
                taken.add(id(v.seq))
                lib().llama_memory_seq_rm(m.llama.memory, v.seq.id, v.n_tokens - 5, v.n_tokens - 3)
                break
        return fork_leaves(pool, rows)

    monkeypatch.setattr(tree, "_fork_leaves", racing)
    options = [" ok", " and then", " the"]
    out = window.generator("plain", "choice", arg=tuple(options))(cut)
    assert len(taken) >= 2  # (found stale twice at least: the case this test makes)
    check_state(window, out, [0.0] * 4)
    check_choice(window, cut, out, options)


def _family(b):
    """Two continuations of one 12-token prompt, as decode makes them: ``a`` on the prompt's own sequence (extended in
    place), ``c`` on a fork sharing the prompt's cells. Returns ``a``, ``c``, ``c``'s ids, a draw of fresh ids, and
    ``run(view, ids)``: those ids decoded after the view, every logit kept."""
    import numpy as np

    from continuum.models.llamacpp.decode import DecodeRow, decode

    pool = b.model.pool
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(3, b.model.llama.n_vocab, n).tolist()  # noqa: E731
    prompt, ta, tc = ids(12), ids(4), ids(4)
    v = decode(pool, [DecodeRow(pool.empty(), prompt, "none")]).views[0]
    a = decode(pool, [DecodeRow(v, ta, "none")]).views[0]
    c = decode(pool, [DecodeRow(v, tc, "none")]).views[0]
    assert a.seq is v.seq and c.seq is not v.seq
    v.release()
    return a, c, prompt + tc, ids, lambda view, toks: decode(pool, [DecodeRow(view, toks, "all")])


def _continues_as_llama_cpp(b, c, c_ids, ids, run) -> None:
    import torch

    new = ids(3)
    got = torch.from_numpy(run(c, new).logits).double().log_softmax(-1)
    ref = b.logprobs(c_ids + new)[len(c_ids):]  # (row i: after the ids up to i)
    err = (got - ref).abs().max().item()
    assert err <= b.tol, f"the restored sample read over holes: log-probs off llama.cpp's evaluation by {err:.2f}"


def test_a_member_restored_beside_a_relative_cut_back_over_gaps_does_not_share_its_window():
    """A spilled sample is restored beside its resident sibling, sharing their common prefix (``reshare.restore``).
    Where that prefix reaches into the window the sample's next decode reads, the sibling must hold those cells; a
    probe compares the range with as many cells behind the sibling's end, which llama.cpp never gives away. A sibling
    cut back over gaps (``window.check_cut`` marks it broken) has holes behind its end too, which the probe cannot
    see: here one inside the shared window and one as far behind the sibling's end. It was shared anyway, and the
    sample's continuation read over the hole silently (the long oracle under the cell audit, window-8 GGUF: "seq 5
    at pos 15 misses window [10]"). Now a broken relative shares only the prefix below the window. Failed before
    (13.9 nats off llama.cpp's evaluation)."""
    from oracle_backends import own_llama

    b = own_llama(256, kind="window")
    pool, n_swa = b.model.pool, b.model.llama.n_swa
    a, c, c_ids, ids, run = _family(b)
    shared, end_a, sa = 12, a.n_tokens, a.seq
    assert c.n_tokens - n_swa + 1 < shared - 1  # (the shared prefix reaches into the window c's next decode reads)
    a2 = run(a, ids(30)).views[0]  # (a's sequence decodes on in place: a's view stays behind its end)
    assert a2.seq is sa and sa.extent > end_a + n_swa
    with pool.model.lock:
        pool.spill(c.seq)
        for g in (shared - 1, end_a - 2):  # (a hole in the shared window, one in as many cells behind a's end)
            pool.drop(sa.id, g, g + 1)
    a2.release()
    assert pool.n_free and sa.broken and sa.extent == end_a  # (cut back to a's view over the holes: broken)
    _continues_as_llama_cpp(b, c, c_ids, ids, run)


def test_a_member_restored_beside_a_relative_shorter_than_their_common_prefix_does_not_share_past_its_end():
    """The probe's other edge: a relative whose cells end before the common prefix (its window cache no longer
    reaches it) holds nothing there to share; the probe was skipped as if the range were the window behind its end.
    Now a range past a sequence's end is never intact (``gaps.intact``). Failed before (16.8 nats off)."""
    from oracle_backends import own_llama

    b = own_llama(256, kind="window")
    pool = b.model.pool
    a, c, c_ids, ids, run = _family(b)
    assert c.n_tokens - b.model.llama.n_swa + 1 < 11
    with pool.model.lock:
        pool.spill(c.seq)
        pool.drop(a.seq.id, 11, -1)  # (a's cells end inside the common prefix, behind the pool's back)
    _continues_as_llama_cpp(b, c, c_ids, ids, run)
