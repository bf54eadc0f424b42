"""Any load on a fixed pool (issue 42): the engine parks the newest call when a step finds no room in llama.cpp's KV
cells or sequence ids, and resumes it when room is back (``continuum.loop.scheduler``); only a call that cannot fit
alone is refused.

Contract, on the stories260K f32 GGUF in the batch-invariant mode with a 256- or 512-cell pool: every call completes;
each program's tokens are llama.cpp's own greedy choice wherever the reference's top-2 margin exceeds ``DECODE_TOL``
(``check_greedy_path``: the default mode's contract), and, since the scheduler keeps every sequence's cells in
position order (released cells kept until room is needed, then the pool packed: ``cells.flush``), exactly each
call alone (``tests/test_scheduler_plan.py`` checks the weights bit for bit).
"""

from __future__ import annotations

import pytest
import torch

from continuum import continuous, generate, models, run_batch, samplers
from continuum.errors import ContextLengthError

from llamacpp_support import DECODE_TOL, check_greedy_path, gguf, row_ids

WORDS = ["cat", "dog", "bird", "king", "girl", "boy", "tree", "ship", "sun", "moon", "fish", "frog"]
PROMPTS = [f"Once upon a time, a {w} {i}" for i in range(4) for w in WORDS]  # 48
# One llama.cpp thread: stories260K gains nothing from two, and two OpenMP threads meet at a barrier after every
# graph node, which on a loaded 2-core machine stalls (a 60-token call: 0.1 s with one thread, 0.5-8 s with two,
# measured). Results do not depend on the thread count (each thread computes whole rows).
THREADS = 1


@pytest.fixture(scope="module")
def small():
    return models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=THREADS, n_ctx=512)


@pytest.fixture(scope="module")
def roomy():
    return models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=THREADS, n_ctx=8192)


def test_run_batch_of_48_programs_on_a_512_cell_pool_completes(small, roomy):
    """48 programs x 60 tokens need ~3,400 cells; the pool has 512: the scheduler admits what fits with what each may
    still add (rows x max_tokens), the others wait in order; none fails, and no decode fails for want of room."""
    small.engine.reset_stats()
    gen = continuous(generate.text(small, samplers.greedy()))
    got = run_batch(lambda p: gen(p, max_tokens=60), PROMPTS)
    stats = small.engine.stats()
    assert stats["no_room"] == 0 and stats["parked_calls"] == 0 and stats["waiting_calls"] == 0
    assert 1 < stats["peak_rows"] <= small.engine.max_rows  # (programs' rows shared steps, within the admission bound)
    alone = [continuous(generate.text(roomy, samplers.greedy()))(p, max_tokens=60) for p in PROMPTS]
    equal = 0
    for state, ref in zip(got, alone):
        ids = row_ids(state)
        assert len(ids) == len(row_ids(ref))  # (every program ran its 60 tokens: this model never ends a story early)
        check_greedy_path(ids, len(ids) - 60)
        equal += str(state) == str(ref)
    assert equal >= len(PROMPTS) // 2  # (most never meet a near-tie: the comparison above is not vacuous)


def test_three_call_chains_under_pressure_each_continue_their_own_state(small):
    """Each program continues its own state twice; states held between calls are spilled (idle), then restored."""
    gen = continuous(generate.text(small, samplers.greedy()))

    def chain(p):
        s1 = gen(p, max_tokens=20)
        s2 = gen(s1 + " Then", max_tokens=20)
        return s1, s2, gen(s2 + " At last", max_tokens=20)

    got = run_batch(chain, PROMPTS[:24])
    for p, (s1, s2, s3) in zip(PROMPTS[:24], got):
        assert str(s1).startswith(p) and str(s2).startswith(str(s1) + " Then") and str(s3).startswith(str(s2) + " At last")
        ids = row_ids(s3)
        check_greedy_path(ids, len(ids) - 20)


def test_a_list_call_larger_than_the_pool_runs_in_turns_and_a_row_that_cannot_fit_is_refused(small):
    """A list call whose rows together need more cells than the pool has (64 prompts of ~40 tokens, 512 cells) runs
    in parts that fit (``turns.row_limit``: cells as well as ids); one row longer than the pool is refused clearly,
    and the model works after."""
    gen = generate.text(small, samplers.greedy())
    long = [f"{p}, and then the story went on and on for a long long time" * 2 for p in PROMPTS[:16]] * 4
    out = gen(long, max_tokens=4)
    assert len(out) == 64 and out[:16] == out[16:32]  # (the same prompts give the same texts in other parts)
    with pytest.raises(ContextLengthError, match="context"):  # (the pool is the context: said before anything runs)
        gen(" ".join(long[:8]), max_tokens=4)
    assert small.engine.stats()["parked_calls"] == 0
    assert gen(PROMPTS[0], max_tokens=8) == generate.text(small, samplers.greedy())(PROMPTS[0], max_tokens=8)


def test_a_list_call_of_300_prompts_runs_in_turns():
    """300 prompts are more rows than the pool's 256 sequence ids: the call runs as parts of at most that many
    (``continuum.loop.turns``), stacked back in order; each row as the same prompt gives in a smaller call (texts),
    llama.cpp's own greedy choice where the margin is clear."""
    model = models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=THREADS, n_ctx=8192)
    assert model.max_call_rows == 254  # (the invariant mode keeps two ids: a scratch row, the released cells)
    prompts = [f"Story {i}: once" for i in range(300)]
    gen = continuous(generate.text(model, samplers.greedy()))
    state = gen(prompts, max_tokens=6)
    assert state.batch == 300 and [str(s) for s in state][:3] == [str(gen(p, max_tokens=6)) for p in prompts[:3]]
    parts = [t for k in range(0, 300, 100) for t in list(gen(prompts[k:k + 100], max_tokens=6))]
    assert sum(a == b for a, b in zip(list(state), parts)) >= 290  # (a near-tie may flip a row: placement, above)
    for r in range(0, 300, 7):
        ids = row_ids(state, r)
        assert list(state)[r].startswith(prompts[r])
        check_greedy_path(ids, len(ids) - 6)


def test_multinomial_300_draws_its_samples_in_groups():
    """300 independent samples of one prompt are more rows than a step holds: they are drawn in groups (of the engine's
    max_rows at most, 32 by default: 10 groups of 30),
    each a call with its own generator seeded from the caller's, so the result is those two smaller calls (the same
    rows; weights within the placement tolerance) and a seeded call is reproducible; beams, which must advance
    together, are refused clearly."""

    from continuum.errors import SequencesExhaustedError

    model = models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=THREADS, n_ctx=8192)
    gen = continuous(generate.text(model, samplers.multinomial(300)))
    state = gen("Once upon a time", max_tokens=8, rng=torch.Generator().manual_seed(3))
    assert (state.batch, state.samples) == (1, 300)
    rng = torch.Generator().manual_seed(3)
    limit = min(model.max_call_rows, model.engine.max_rows)  # (ids, and the engine's rows per step: 32 by default)
    groups = -(-300 // limit)
    sizes = [300 // groups + (g < 300 % groups) for g in range(groups)]
    seeds = [int(torch.randint(0, 2**62, (1,), generator=rng)) for _ in range(groups)]
    parts = [continuous(generate.text(model, samplers.multinomial(n)))("Once upon a time", max_tokens=8,
                                                                        rng=torch.Generator().manual_seed(s))
             for n, s in zip(sizes, seeds)]
    assert list(state) == sum((list(p) for p in parts), [])
    # (the groups ran beside each other, the parts one after the other: cells placed otherwise, see the top)
    assert torch.allclose(state.weights, torch.cat([p.weights for p in parts], 1), atol=DECODE_TOL["f32"])
    assert len(set(state)) > 50  # (independent draws)
    with pytest.raises(SequencesExhaustedError, match="sequence ids"):
        generate.text(model, samplers.beam_search(300))("Once upon a time", max_tokens=2)
    assert generate.text(model, samplers.greedy())("Once", max_tokens=3)  # (the model works after)


# -- issue 56's oracle findings on a pool that states fill (tests/test_oracle.py has the histories that found them) --

def _own(n_ctx: int, invariant: bool):
    return models.llamacpp(gguf("f32"), batch_invariant=invariant, n_threads=THREADS, n_ctx=n_ctx,
                           **(dict(n_seq_max=16) if n_ctx < 512 else {}))


@pytest.mark.parametrize("invariant", [False, True])
def test_a_cut_of_a_state_that_fills_the_pool_continues(invariant):
    """A held state generated to the context holds every cell; a cut of it continued (text, a choice) needs only its
    prefix, which the new rows share, and its new tokens' cells: the rest of the held state is spilled for them
    (before: KVCacheFullError 'no free KV cell for 3 new tokens'; the state was pinned as the fork's source)."""
    model = _own(256, invariant)
    full = continuous(generate.text(model, samplers.greedy()))("Once upon a time", max_tokens=None)
    assert full.finish_reasons == [["context"]] and len(row_ids(full)) >= 255
    cut = full[..., :60] + " ok?"
    n = len(row_ids(cut))
    text = continuous(generate.text(model, samplers.greedy()))(cut, max_tokens=8)
    assert row_ids(text)[:n] == row_ids(cut) and len(row_ids(text)) == n + 8
    check_greedy_path(row_ids(text), n)
    pick = continuous(generate.choice(model, [" the", " there", " then"]))(cut)
    assert pick.value in (" the", " there", " then") and row_ids(pick)[:n] == row_ids(cut)
    assert str(full).startswith(str(cut)[:-4])  # (the spilled state is intact: restored when read)
    again = continuous(generate.text(model, samplers.greedy()))(full[..., :80], max_tokens=2)
    assert row_ids(again)[:-2] == row_ids(full[..., :80])


@pytest.mark.parametrize("invariant", [False, True])
def test_a_dropped_state_gives_its_cells_back_while_an_earlier_state_of_its_line_is_held(invariant):
    """A state continued in place to the context, then dropped: its cells beyond the longest state still held come
    back at once (before: 1023 of 1024 cells stayed in use, and continuing the held ancestor raised KVCacheFullError)."""
    import gc

    from continuum.models.llamacpp import cells

    model = _own(1024, invariant)
    text = continuous(generate.text(model, samplers.greedy()))
    a = text(["Once upon a time", "The cat"], max_tokens=3)
    held = text(a, max_tokens=2)
    full = text(held + ".", max_tokens=None)
    assert full.finish_reasons == [["context"], ["context"]]
    del full
    gc.collect()
    pool = model.pool
    with model.llama.lock:
        pool.collect()
        cells.flush(pool)  # (the invariant mode keeps released cells until room is needed: count them freed)
        assert cells.used(pool) == sum(len(row_ids(held, r)) - 1 for r in range(2))  # (the last token: uncached)
    out = text(a, max_tokens=2)
    for r in range(2):
        check_greedy_path(row_ids(out, r), len(row_ids(a, r)))


def test_a_step_keeps_the_forks_it_made_resident_while_a_token_tree_makes_room():
    """The deterministic core of the oracle's asyncio.gather finding on a 256-cell pool: one step holds a call's
    decode that forks 6 rows off a 2-row state and another call's choice tree. The tree is decoded after the forks,
    and made room by spilling them (they were new, so not yet held by the step), and the call's next step had to
    restore 6 rows of 115 positions apart: 'no room to restore a spilled state'. The forks stay resident now; the tree
    finds no room and waits (KVCacheFullError, which the engine answers by running it at a later step)."""

    from continuum.errors import KVCacheFullError
    from continuum.models import kv, token_tree
    from continuum.models.request import Request

    model = _own(256, False)
    gen = continuous(generate.text(model, samplers.greedy()))
    x = gen(["Once upon a time", "The cat"], max_tokens=110)  # 2 x ~114 cells
    y = gen("Lily", max_tokens=20)  # 21 more: 6 cells are left for the step
    C, idx = kv.length(x._kv), torch.tensor([0, 0, 0, 1, 1, 1])
    fork = Request(x._ids[idx, C:], x._mask[idx], kv.positions(x._mask)[idx, C:], x._kv.select_rows(idx), normalize=True)
    Cy, tok = kv.length(y._kv), model.tokenizer  # (choice scoring's tree on y, as loop/scoring.py builds it)
    t = token_tree.build(y._ids[:, Cy].tolist(), (y._mask.sum(1) - 1).tolist(),
                         [[tok.encode_continuation(o) for o in (" cat", " dog", " big dog")]], y._mask[:, :Cy], tok.pad_token_id)
    tree = Request(t.ids, torch.cat([y._mask[:, :Cy], t.real], 1), t.positions, y._kv, logits="all", allowed=t.allowed)
    counters = {"forward_s": 0.0, "merged_forwards": 0, "requests_merged": 0, "fallbacks": 0}
    model.hold([fork, tree])  # (as the engine does around a step)
    model.run_step([fork, tree], counters)
    model.hold([])
    assert fork.error is None and isinstance(tree.error, KVCacheFullError)
    views = fork.result[1].views
    assert [v.seq_id is not None for v in views] == [True] * 6 and model.pool.spills == 0
    del tree, y  # (the choice call waits; the fork call's next step)
    mask = torch.cat([x._mask[idx], torch.ones(6, 1, dtype=x._mask.dtype)], 1)
    nxt = Request(torch.tensor(fork.top[0])[:, None], mask, kv.positions(mask)[:, -1:], fork.result[1], normalize=True)
    model.run_step([nxt], counters)
    assert nxt.error is None and model.pool.restores == 0
