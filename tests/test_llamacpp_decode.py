"""One llama_decode for many rows (continuum.models.llamacpp.decode) against llama-cpp-python's own evaluation
(``Llama(logits_all=True).eval`` of the same ids). Tolerances: see tests/llamacpp_support.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from continuum.errors import ContextLengthError, GeneratorArgumentError
from continuum.models.llamacpp import DecodeRow, decode
from continuum.models.llamacpp.decode import FA_TILE_ROWS, PACK_FROM, chunks, decode_chunks

from llamacpp_support import DECODE_TOL, load, reference_logits

PROMPTS = ["Once upon a time, there was a little girl named Lily.", "The dog ran to the park and", "Tom had a red ball"]


def _ids(tok, text):
    return tok.encode_prompts([text])[0]


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
@pytest.mark.parametrize("invariant", [False, True])
def test_prefill_equals_llama_cpp_python(kind, invariant):
    model, tok, pool = load(kind, batch_invariant=invariant)
    assert model.flash_attn  # (the default in both modes)
    for text in PROMPTS:
        ids = _ids(tok, text)
        out = decode(pool, [DecodeRow(pool.empty(), ids, "all")])
        assert out.logits.shape == (len(ids), tok.n_vocab) and out.logits.dtype == np.float32
        np.testing.assert_array_equal(out.logits, reference_logits(kind, ids, flash_attn=True))
        assert out.views[0].n_tokens == len(ids)


def _greedy_steps(pool, ids, n):
    """Greedy decoding one token at a time after a prefill: the path and each step's logits."""
    out = decode(pool, [DecodeRow(pool.empty(), ids)])
    view, path, steps = out.views[0], list(ids), [out.row(0)[-1]]
    for _ in range(n):
        path.append(int(steps[-1].argmax()))
        out = decode(pool, [DecodeRow(view, [path[-1]])])
        view = out.views[0]
        steps.append(out.row(0)[-1])
    return path, np.stack(steps[:-1])


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_continued_view_equals_a_fresh_evaluation_in_invariant_mode(kind):
    """A state continued token by token equals llama-cpp-python's one prefill of the same ids, exactly."""
    _, tok, pool = load(kind, batch_invariant=True)
    ids = _ids(tok, PROMPTS[0])
    path, got = _greedy_steps(pool, ids, 24)
    np.testing.assert_array_equal(got, reference_logits(kind, path, flash_attn=True)[len(ids) - 1:-1])


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_continued_view_equals_a_fresh_evaluation_within_tolerance(kind):
    """The default mode: one-row decodes take other kernels than a prefill; within DECODE_TOL, same greedy tokens
    where the reference's top-2 margin exceeds it."""
    _, tok, pool = load(kind)
    ids = _ids(tok, PROMPTS[0])
    path, got = _greedy_steps(pool, ids, 24)
    ref = reference_logits(kind, path)[len(ids) - 1:-1]
    diff = np.abs(got - ref).max()
    assert diff <= DECODE_TOL[kind], diff  # f32: 0.003-0.009; q8_0: 0 here
    top2 = np.sort(ref, axis=1)[:, -2:]
    sure = (top2[:, 1] - top2[:, 0]) > DECODE_TOL[kind]
    assert sure.sum() >= len(got) // 2  # the comparison below is not empty
    np.testing.assert_array_equal(got.argmax(1)[sure], ref.argmax(1)[sure])


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_chunked_prefill_is_exact_in_invariant_mode(kind):
    _, tok, pool = load(kind, batch_invariant=True)
    ids = _ids(tok, PROMPTS[0] + " " + PROMPTS[1])
    whole = decode(pool, [DecodeRow(pool.empty(), ids, "all")]).logits
    first = decode(pool, [DecodeRow(pool.empty(), ids[:8], "all")])
    second = decode(pool, [DecodeRow(first.views[0], ids[8:], "all")])
    np.testing.assert_array_equal(np.concatenate([first.logits, second.logits]), whole)
    last = decode(pool, [DecodeRow(first.views[0], ids[8:])])  # one output row: padded like a merged step
    np.testing.assert_array_equal(last.row(0), whole[-1:])


def _merged_vs_alone(pool, tok):
    """The largest |difference| between rows decoded together (in both orders) and each alone, prefills then
    continuations of different widths on live states."""
    prompts = [_ids(tok, p) for p in PROMPTS]
    alone = [decode(pool, [DecodeRow(pool.empty(), ids, "all")]) for ids in prompts]
    together = decode(pool, [DecodeRow(pool.empty(), ids, "all") for ids in prompts])
    swapped = decode(pool, [DecodeRow(pool.empty(), ids, "all") for ids in prompts[::-1]])
    diffs = []
    for i, a in enumerate(alone):
        diffs += [np.abs(together.row(i) - a.logits).max(), np.abs(swapped.row(len(prompts) - 1 - i) - a.logits).max()]
    more = [[5, 6, 7], [9], [11, 12]]
    merged = decode(pool, [DecodeRow(v, m, "all") for v, m in zip(together.views, more)])
    for i, (a, m) in enumerate(zip(alone, more)):
        diffs.append(np.abs(merged.row(i) - decode(pool, [DecodeRow(a.views[0], m, "all")]).logits).max())
    steps = decode(pool, [DecodeRow(v, [3]) for v in merged.views])  # one token per row, as in a decoding step
    for i, v in enumerate(merged.views):
        diffs.append(np.abs(steps.row(i) - decode(pool, [DecodeRow(v, [3])]).row(0)).max())
    return float(max(diffs))


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_rows_in_one_decode_equal_each_alone_in_invariant_mode(kind):
    _, tok, pool = load(kind, batch_invariant=True)
    assert _merged_vs_alone(pool, tok) == 0.0


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_rows_in_one_decode_are_close_to_alone_in_default_mode(kind):
    _, tok, pool = load(kind)
    assert _merged_vs_alone(pool, tok) <= DECODE_TOL[kind]


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_prompts_packed_into_one_wide_decode_are_close_to_each_alone(kind):
    """Prompts of 16+ tokens are packed into one decode past the 64-row attention tile (``PACK_FROM``): the tiled
    kernel runs over tiles spanning several sequences, masked by sequence; every position's logits stay within the
    stated tolerance of each prompt decoded alone, in either order, and of llama-cpp-python's own evaluation."""
    _, tok, pool = load(kind)
    texts = [" ".join(PROMPTS[i:] + PROMPTS[:i]) for i in range(3)] + [PROMPTS[0] + " " + PROMPTS[0]]
    prompts = [_ids(tok, t) for t in texts]
    assert min(map(len, prompts)) >= PACK_FROM and sum(map(len, prompts)) >= FA_TILE_ROWS
    ids = np.concatenate([np.full(len(p), i) for i, p in enumerate(prompts)])
    assert decode_chunks(pool, ids) == [(0, len(ids))]  # one decode
    alone = [decode(pool, [DecodeRow(pool.empty(), p, "all")]).logits for p in prompts]
    for order in (prompts, prompts[::-1]):
        together = decode(pool, [DecodeRow(pool.empty(), p, "all") for p in order])
        for i, p in enumerate(order):
            assert np.abs(together.row(i) - alone[prompts.index(p)]).max() <= DECODE_TOL[kind]
            assert np.abs(together.row(i) - reference_logits(kind, p, flash_attn=True)).max() <= DECODE_TOL[kind]


def test_logits_selection_and_offsets():
    _, tok, pool = load("f32", batch_invariant=True)
    ids = _ids(tok, PROMPTS[0])
    full = decode(pool, [DecodeRow(pool.empty(), ids, "all")]).logits
    out = decode(pool, [DecodeRow(pool.empty(), ids, [0, 3, -1]), DecodeRow(pool.empty(), ids, "none"),
                        DecodeRow(pool.empty(), ids), DecodeRow(pool.empty(), [])])
    assert out.offsets == [0, 3, 3, 4, 4]
    np.testing.assert_array_equal(out.row(0), full[[0, 3, -1]])
    np.testing.assert_array_equal(out.row(2), full[-1:])
    assert out.row(1).shape == (0, tok.n_vocab) and out.views[3].n_tokens == 0


def test_chunks_at_n_batch_equal_one_batch():
    """A decode longer than n_batch runs in chunks: the same logits as a model whose n_batch holds it whole."""
    small, tok, small_pool = load("f32", batch_invariant=True, n_seq_max=4, n_batch=16, n_ubatch=16)
    big, _, big_pool = load("f32", batch_invariant=True, n_seq_max=4, n_batch=256, n_ubatch=16)
    rows = [_ids(tok, PROMPTS[0]), _ids(tok, PROMPTS[1] + " " + PROMPTS[2])]
    assert sum(map(len, rows)) > 2 * small.n_batch
    a = decode(small_pool, [DecodeRow(small_pool.empty(), r, "all") for r in rows])
    b = decode(big_pool, [DecodeRow(big_pool.empty(), r, "all") for r in rows])
    np.testing.assert_array_equal(a.logits, b.logits)
    assert a.offsets == b.offsets


def test_bad_rows_are_refused_before_decoding():
    model, tok, pool = load("f32")
    ids = _ids(tok, "Hi there")
    view = decode(pool, [DecodeRow(pool.empty(), ids)]).views[0]
    free = pool.n_free
    with pytest.raises(GeneratorArgumentError, match="token ids"):
        decode(pool, [DecodeRow(view, [tok.n_vocab])])
    with pytest.raises(GeneratorArgumentError, match="token ids"):
        decode(pool, [DecodeRow(view, [-1])])
    with pytest.raises(GeneratorArgumentError, match="logits"):
        decode(pool, [DecodeRow(view, [5], "first")])
    with pytest.raises(GeneratorArgumentError, match="outside"):
        decode(pool, [DecodeRow(view, [5], [1])])
    with pytest.raises(ContextLengthError, match="context"):
        decode(pool, [DecodeRow(view, [5] * model.context_length)])
    assert pool.n_free == free and view.n_tokens == len(ids)
    assert pool.positions(view) == (0, view.n_tokens - 1)


def test_threads_share_one_model():
    """Decodes from several threads are serialised by the model's lock; each thread's results equal its run alone
    within the decode tolerance, with the same greedy tokens. Not exactly: where a sequence's cells land among other
    live sequences' cells moves its logits (0.27 measured on q8_0 with six threads), even in the batch-invariant
    mode, which makes rows independent of their step's company, not of the cache's layout."""
    import threading

    _, tok, pool = load("q8_0", batch_invariant=True)
    prompts = [_ids(tok, p) for p in PROMPTS]

    paths = [_greedy_steps(pool, ids, 8)[0] for ids in prompts]

    def run(k):  # teacher-forced along prompt k's greedy path, one decode per token
        ids, path = prompts[k], paths[k]
        out = decode(pool, [DecodeRow(pool.empty(), ids)])
        view, logits = out.views[0], [out.row(0)[-1]]
        for token in path[len(ids):]:
            out = decode(pool, [DecodeRow(view, [token])])
            view = out.views[0]
            logits.append(out.row(0)[-1])
        return np.stack(logits)

    alone = [run(k) for k in range(3)]
    results: dict[int, np.ndarray] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(i % 3))) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(6):
        ref = alone[i % 3]
        assert np.abs(results[i] - ref).max() <= DECODE_TOL["q8_0"]
        top2 = np.sort(ref, axis=1)[:, -2:]
        sure = (top2[:, 1] - top2[:, 0]) > DECODE_TOL["q8_0"]
        np.testing.assert_array_equal(results[i].argmax(1)[sure], ref.argmax(1)[sure])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 150), min_size=1, max_size=40), st.sampled_from([8, 16, 63, 64, 255, 512]),
       st.sampled_from([None, PACK_FROM]))
def test_chunks_cover_the_batch_and_keep_rows_of_several_sequences_under_the_attention_tile(lengths, step, pack):
    """Every decode holds at most ``step`` tokens, in batch order; one of ``FA_TILE_ROWS`` rows or more holds one
    sequence, or (``pack``) only runs of ``pack`` tokens or more, so none of its tiles spans more than a few sequences;
    a run that fits a decode is never cut."""
    ids = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
    got = chunks(ids, step, pack)
    assert got[0][0] == 0 and got[-1][1] == len(ids)
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))  # contiguous, in order: outputs stay in batch order
    for s, e in got:
        assert 0 < e - s <= step
        inside = [lengths[i] for i in sorted(set(ids[s:e].tolist()))]
        assert len(inside) == 1 or e - s < FA_TILE_ROWS or (pack is not None and min(inside) >= pack)
    starts = {s for s, _ in got}
    bounds = np.cumsum([0, *lengths])
    for a, n in zip(bounds, lengths):  # a run is never cut when it fits: its tokens decode together
        if (n < FA_TILE_ROWS or pack is not None) and n <= step:
            assert not any(a < s < a + n for s in starts)
    if pack is not None:  # prompts are packed: as few decodes as the runs allow
        assert len(got) <= sum(math.ceil(n / step) for n in lengths)
        if all(n >= pack for n in lengths) and len(ids) <= step:
            assert len(got) == 1


def test_a_step_of_more_rows_than_an_attention_tile_equals_each_row_alone_in_invariant_mode():
    """100 one-token rows: the decode runs them in chunks under flash attention's 64-row tile, whose tiled kernel
    would round differently (and walk every row's cells): each row equals itself decoded alone."""
    _, tok, pool = load("f32", batch_invariant=True)
    prompts = [_ids(tok, PROMPTS[i % len(PROMPTS)]) + [7 + i] for i in range(100)]
    views = decode(pool, [DecodeRow(pool.empty(), p) for p in prompts]).views
    step = decode(pool, [DecodeRow(v, [3]) for v in views])
    for i in (0, 37, 63, 64, 99):
        np.testing.assert_array_equal(step.row(i), decode(pool, [DecodeRow(views[i], [3])]).row(0))


@pytest.mark.parametrize("hold", ["numpy view", "tensor view", "memoryview"])
def test_a_decodes_logits_are_never_overwritten_while_anything_reads_them(hold):
    """Decodes reuse the arrays they copy logits into (``outputs.py``), but only once nothing refers to one: a later
    decode of the same shape never writes where an earlier result can still be read, however it is held; once that
    reference goes, the array is handed out again."""
    import torch

    _, tok, pool = load("f32")
    rows = [_ids(tok, PROMPTS[0]), _ids(tok, PROMPTS[2])]
    first = decode(pool, [DecodeRow(pool.empty(), r) for r in rows])
    want, owner = first.logits.copy(), first.logits.base
    ref = {"numpy view": lambda a: a[1:], "tensor view": lambda a: torch.from_numpy(a)[1:],
           "memoryview": lambda a: memoryview(a)[1:]}[hold](first.logits)
    owner_id = id(owner)
    del first, owner  # (only `ref` reads the first result now)
    for text in PROMPTS[1:]:  # other ids, the same shape: their logits differ
        again = decode(pool, [DecodeRow(pool.empty(), _ids(tok, text)), DecodeRow(pool.empty(), rows[0])])
        assert id(again.logits.base) != owner_id
        np.testing.assert_array_equal(np.asarray(ref), want[1:])
        del again
    del ref
    reused = decode(pool, [DecodeRow(pool.empty(), r) for r in rows])
    assert id(reused.logits.base) == owner_id  # (free again: the pool's first array is handed out)
    np.testing.assert_array_equal(reused.logits, want)
    seen = {id(decode(pool, [DecodeRow(pool.empty(), r) for r in rows]).logits.base) for _ in range(4)}
    assert len(seen) == 1  # (nothing holds them: the same array every time)
