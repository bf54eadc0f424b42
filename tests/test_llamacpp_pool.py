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
    import torch

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
