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

from llamacpp_support import DECODE_TOL, check_greedy_path, gemma_path, gguf, reference_logits, row_ids

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
    import torch

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


def _resident(state) -> bool:
    return state._kv.views[0].seq.id is not None


def test_idle_states_past_the_budget_are_spilled_oldest_first_and_continue_as_llama_cpp_evaluates():
    """Every decode's attention in the unified cache runs over every cell in use, so idle cells (states held between
    calls) slow every later step: past ``idle_cells`` beside the running ones, the least recently used idle states
    are spilled (the newest kept); a spilled state continues from its restored cells, as llama.cpp's own evaluation
    says (the default mode's contract)."""
    from continuum.errors import ModelLoadError
    from continuum.models.llamacpp import cells

    m = models.llamacpp(gguf("f32"), n_threads=THREADS, n_ctx=2048, idle_cells=64)
    gen = continuous(generate.text(m, samplers.greedy()))
    states = [gen(f"Once upon a time, a {w}", max_tokens=40) for w in WORDS[:6]]  # 6 unrelated states of ~50 cells
    assert [_resident(s) for s in states] == [False] * 4 + [True] * 2  # (the newest idle one and the last call's)
    assert cells.used(m.pool) == sum(len(row_ids(s)) - 1 for s in states[-2:])  # (a state's last token is uncached)
    old = states[0]
    out = gen(old, max_tokens=20)  # restored, then continued
    assert m.pool.restores >= 1 and row_ids(out)[:len(row_ids(old))] == row_ids(old)
    check_greedy_path(row_ids(out), len(row_ids(old)))
    roomy = models.llamacpp(gguf("f32"), n_threads=THREADS, n_ctx=2048, idle_cells=None)
    gen = continuous(generate.text(roomy, samplers.greedy()))
    kept = [gen(f"Once upon a time, a {w}", max_tokens=40) for w in WORDS[:6]]
    assert all(_resident(s) for s in kept) and roomy.pool.spills == 0
    with pytest.raises(ModelLoadError, match="idle_cells"):
        models.llamacpp(gguf("f32"), idle_cells=-1)


# Found by the long oracle (2026-11-29, fifth session; threads on a 256-cell pool, and run_batch in the invariant mode):
# a fork family that fits resident (3 samples of a 105-token state share its cells: ~115 cells) is spilled when
# another call needs the room, and each member is written as its own blob with the shared prefix duplicated
# (llama.cpp's per-sequence state API); restored apart they took 3 x ~108 cells, more than the pool, so continuing
# the fork was refused with KVCacheFullError ("no room to restore a spilled state of 108 tokens") although it fitted.
# Now a restored member shares the prefix it had from the same cells with a resident relative
# (models/llamacpp/reshare.py), in both modes.
def _llama_cpp_agrees(state, first: int, flash_attn: bool) -> None:
    """Each row's log-probs from position ``first`` on are llama-cpp-python's own over the same ids (one prefill, the
    independent reference), within the decode tolerance."""
    for ids, mask, lps in zip(state.token_ids, state.attention_masks, state.token_logprobs):
        keep = mask.bool()
        ids, lps = ids[keep].tolist(), lps[keep]
        ref = torch.log_softmax(torch.from_numpy(reference_logits("f32", ids, flash_attn=flash_attn, first=first - 1)), -1)
        want = ref[torch.arange(len(ids) - first), torch.tensor(ids[first:])]
        assert (lps[first:] - want).abs().max() <= DECODE_TOL["f32"], (lps[first:], want)


def _spilled_fork_family(invariant: bool, n_ctx: int):
    m = models.llamacpp(gguf("f32"), batch_invariant=invariant, n_threads=THREADS, n_ctx=n_ctx, n_seq_max=16)
    text = continuous(generate.text(m, samplers.greedy()))
    three = continuous(generate.text(m, samplers.multinomial(3)))
    s = text("Once upon a time", max_tokens=100)
    forks = three(s, max_tokens=4, rng=torch.Generator().manual_seed(0))  # ~115 cells, shared
    text(["The cat sat", "A dog ran"], max_tokens=100)  # needs the room: the fork family is spilled
    more = three(forks, max_tokens=6, rng=torch.Generator().manual_seed(1))
    _llama_cpp_agrees(more, len(row_ids(s)), m.llama.flash_attn)
    return m, more


def test_a_spilled_fork_family_that_fitted_resident_continues():
    """Continued after its spill on a 256-cell pool, the forks get what they get on a pool where nothing spills:
    the same tokens, and log-probs within the default mode's tolerance (and within it of llama-cpp-python's own)."""
    m, more = _spilled_fork_family(False, 256)
    assert m.pool.spills > 0 and m.pool.reshared >= 2, (m.pool.spills, m.pool.reshared)
    _, roomy = _spilled_fork_family(False, 2048)
    assert list(more) == list(roomy)
    assert (more.token_logprobs.nan_to_num() - roomy.token_logprobs.nan_to_num()).abs().max() <= DECODE_TOL["f32"]


def test_a_spilled_fork_family_in_the_invariant_mode_continues_bit_for_bit():
    """The same in the batch-invariant mode, where the restored family's cells must stay in position order: the
    same tokens and log-probs, bit for bit, as on the roomy pool."""
    m, more = _spilled_fork_family(True, 256)
    assert m.pool.spills > 0 and m.pool.reshared >= 2, (m.pool.spills, m.pool.reshared)
    _, roomy = _spilled_fork_family(True, 2048)
    assert list(more) == list(roomy) and torch.equal(more.weights, roomy.weights)
    assert torch.equal(more.token_logprobs.nan_to_num(), roomy.token_logprobs.nan_to_num())


@pytest.mark.slow
def test_a_spilled_fork_family_on_a_sliding_window_model_continues():
    """Gemma 3 (a 512-token window): each restored member's bytes hold every position in the base cache but only the
    window behind its end in the window cache. Three samples of a ~535-token prompt fit a 1,280-cell pool resident
    (~545 cells), not restored apart (3 x ~540); shared again on restore, the forks continue, and their greedy
    continuations are llama-cpp-python's own (past the window: the relative's window cells must be the right ones)."""
    from test_llamacpp_window_recompute import COLORS, STORY, _ids

    m = models.llamacpp(str(gemma_path()), n_ctx=1280, n_threads=THREADS, flash_attn=False)
    prompt = "".join(STORY.format(i=i, c=COLORS[i % 6], n=10 + i) for i in range(12))
    forks = continuous(generate.text(m, samplers.multinomial(3)))(prompt, max_tokens=4, rng=torch.Generator().manual_seed(0))
    start = len(_ids(forks[0, 0, :]))
    assert 520 < start < 560
    continuous(generate.text(m, samplers.greedy()))("The lighthouse keeper wrote down " * 160, max_tokens=2)
    assert m.pool.spills >= 3  # (~800 cells: the idle family was spilled)
    greedy3 = continuous(generate.text(m, samplers.multinomial(3, top_k=1)))  # (each row its argmax: greedy)
    more = greedy3(forks, max_tokens=6)
    assert m.pool.reshared >= 2, (m.pool.spills, m.pool.reshared)
    for j in range(3):
        check_greedy_path(_ids(more[0, j, :]), len(_ids(forks[0, j, :])), kind="gemma", flash_attn=False)


def _family_spilled(invariant: bool, n_ctx: int, spill=None):
    """Three samples of a ~105-token state, ``spill(pool, their sequences)`` applied under the model's lock, then
    continued; their log-probs checked against llama-cpp-python's over the same ids."""
    m = models.llamacpp(gguf("f32"), batch_invariant=invariant, n_threads=THREADS, n_ctx=n_ctx, n_seq_max=16)
    s = continuous(generate.text(m, samplers.greedy()))("Once upon a time", max_tokens=100)
    three = continuous(generate.text(m, samplers.multinomial(3)))
    forks = three(s, max_tokens=4, rng=torch.Generator().manual_seed(0))
    first = len(row_ids(s))
    del s
    if spill is not None:
        with m.pool.model.lock:
            spill(m.pool, [view.seq for view in forks._kv.views])
    more = three(forks, max_tokens=6, rng=torch.Generator().manual_seed(1))
    _llama_cpp_agrees(more, first, m.llama.flash_attn)
    return m, more


def _as_on_a_roomy_pool(invariant: bool, more) -> None:
    """``more`` equals the same program's on a 2,048-cell pool where nothing spills (bit for bit in the invariant
    mode)."""
    _, roomy = _family_spilled(invariant, 2048)
    assert list(more) == list(roomy)
    tol = 0.0 if invariant else DECODE_TOL["f32"]
    assert (more.token_logprobs.nan_to_num() - roomy.token_logprobs.nan_to_num()).abs().max() <= tol


@pytest.mark.parametrize("invariant", [False, True])
def test_a_member_spilled_beside_a_resident_relative_shares_its_prefix_again(invariant):
    """Found by the long oracle (default mode, asyncio-gathered calls on a 256-cell pool): "no room to restore a
    spilled state of 140 tokens". A running call holds one member of a fork family while the idle ones are spilled;
    restored, they shared nothing with the member that never left (only with relatives restored before them), so
    3 x ~108 cells were asked of 256. Staged here by spilling two of three samples; their continuation equals the
    same program's on a 2,048-cell pool where nothing spills (bit for bit in the invariant mode), and its log-probs
    are llama-cpp-python's over the same ids."""
    m, more = _family_spilled(invariant, 256, lambda pool, seqs: [pool.spill(seq) for seq in seqs[1:]])
    assert m.pool.spills >= 2 and m.pool.reshared >= 2, (m.pool.spills, m.pool.reshared)
    _as_on_a_roomy_pool(invariant, more)


@pytest.mark.parametrize("kind, flash_attn", [("f32", True), ("f32", False),
                                              pytest.param("gemma", False, marks=pytest.mark.slow)])
def test_a_spilled_sequence_s_bytes_cut_back_are_llama_cpp_s_own_bytes_of_the_cut_sequence(kind, flash_attn):
    """``seqbytes.cut`` (a spilled sequence's bytes, cells at positions below n only) gives byte for byte what
    llama.cpp writes for the same sequence after ``seq_rm(seq, n, -1)``, and ``seqbytes.tail`` (from n on) what it
    writes after ``seq_rm(seq, 0, n)``, with V rows (flash attention) or V
    transposed, and on Gemma 3 (two caches: every position, and the sliding window's, within the window here);
    bytes it cannot read whole come back as None."""
    from continuum.models.llamacpp import seqbytes, window
    from continuum.models.llamacpp._lib import lib

    path = str(gemma_path()) if kind == "gemma" else gguf("f32")
    m = models.llamacpp(path, n_threads=THREADS, n_ctx=512, flash_attn=flash_attn)
    s = continuous(generate.text(m, samplers.greedy()))(["Once upon a time", "The dog"], max_tokens=44)
    pool, seq = m.pool, s._kv.views[1].seq
    with m.llama.lock:
        full = seqbytes.get(m.llama, seq.id)
        assert seqbytes.cut(full, 10**6) == full
        for n in (40, 17, 5, 1):
            window.cut_tail(pool, seq, n)
            assert seqbytes.cut(full, n) == seqbytes.get(m.llama, seq.id), n
        seq = s._kv.views[0].seq  # ``tail``: the cells from n on, as llama.cpp writes them after seq_rm(seq, 0, n)
        full = seqbytes.get(m.llama, seq.id)
        assert seqbytes.tail(full, 0) == full
        for n in (1, 5, 17, 40, 10**6):
            lib().llama_memory_seq_rm(m.llama.memory, seq.id, 0, n)
            assert seqbytes.tail(full, n) == seqbytes.get(m.llama, seq.id), n
    assert seqbytes.cut(full[:-1], 5) is None and seqbytes.cut(full + b"\0", 5) is None
    assert seqbytes.tail(full[:-1], 5) is None


@pytest.mark.parametrize("invariant", [False, True])
def test_a_spilled_state_whose_longest_view_was_dropped_restores_only_what_its_views_reach(invariant):
    """The long oracle's "no room to restore a spilled state of 255 tokens" (gguf threads, a 256-cell pool): a state
    generated to the context was spilled, then dropped while a short cut of it lived on; the cut's restore wrote the
    whole 255-position bytes back, more than the cells a running call left free, though the cut fits. Now a spilled
    sequence's bytes are cut back with its longest view, and the cut continues as llama-cpp-python evaluates it."""
    import gc

    from continuum.models.llamacpp import cells

    m = models.llamacpp(gguf("f32"), batch_invariant=invariant, n_threads=THREADS, n_ctx=256, n_seq_max=16)
    text = continuous(generate.text(m, samplers.greedy()))
    full = text("Once upon a time", max_tokens=None)
    cut = full[..., :30]
    pool, seq = m.pool, full._kv.views[0].seq
    with m.llama.lock:
        pool.spill(seq)
    del full
    gc.collect()
    running = text("The cat sat on the mat", max_tokens=180)  # ~190 cells, held as a running call's
    with m.llama.lock:
        pool.held = {id(running._kv.views[0].seq)}
        pool.ensure_resident(seq)  # (before: KVCacheFullError, 255 cells asked of the ~66 free)
        assert seq.extent == len(row_ids(cut)) - 1 and cells.used(pool) <= 256
        pool.held = set()
    out = text(cut, max_tokens=6)
    assert row_ids(out)[:len(row_ids(cut))] == row_ids(cut)
    _llama_cpp_agrees(out, len(row_ids(cut)), m.llama.flash_attn)


@pytest.mark.parametrize("invariant", [False, True])
def test_short_views_of_long_spilled_states_restore_only_their_own_positions(invariant):
    """Found by the long oracle (gguf, run_batch, 256 cells): "no room to restore a spilled state of 128 tokens". A
    2-row state's sequences were extended in place by a long call whose result lives on, both spilled; continuing
    the short state forks each row from its sequence, and the fork restored each whole (2 x 128 cells asked of 256)
    though the rows need their first few positions. Now the fork is written from the bytes cut at the view's end;
    the long state stays spilled and whole, and both continue as llama-cpp-python evaluates them."""
    m = models.llamacpp(gguf("f32"), batch_invariant=invariant, n_threads=THREADS, n_ctx=256, n_seq_max=16)
    text = continuous(generate.text(m, samplers.greedy()))
    short = text(["Once upon a time", "One day a cat"], max_tokens=1)
    long = text(short, max_tokens=126)  # each row's sequence extended in place, to ~130 positions
    with m.llama.lock:
        m.pool.collect()
        for seq in {id(v.seq): v.seq for v in long._kv.views}.values():
            if seq.id is not None:  # (2 x ~130 positions on 256 cells: one may be spilled already)
                m.pool.spill(seq)
    assert all(v.seq.extent >= 128 and v.seq.id is None for v in short._kv.views)
    out = text(short, max_tokens=4)  # (before: KVCacheFullError, "a spilled state of 13x tokens")
    _llama_cpp_agrees(out, max(len(ids) for ids, _ in short._real_rows()), m.llama.flash_attn)
    again = text(long, max_tokens=2)  # the long state, restored whole, continues too
    _llama_cpp_agrees(again, max(len(ids) for ids, _ in long._real_rows()), m.llama.flash_attn)


@pytest.mark.parametrize("invariant", [False, True])
def test_a_member_spilled_twice_still_shares_its_prefix_with_its_family(invariant):
    """Found by the long oracle (gguf threads, 256 cells): "no room to restore a spilled state of 125 tokens". A
    restored sequence recorded only that its cells came from the bytes of its own last spill, so a member of a fork
    family restored and spilled again (while its relatives stayed spilled) had nothing in common with them any more:
    restored together, 3 x ~108 cells were asked of 256. What a sequence's cells hold is now kept through any number
    of spills (``cells.content``); the family continues as on a 2,048-cell pool where nothing spills."""
    def spill(pool, seqs):
        for seq in seqs:
            pool.spill(seq)
        pool.ensure_resident(seqs[0])  # (restored alone, then spilled again: its relatives still spilled)
        pool.spill(seqs[0])

    m, more = _family_spilled(invariant, 256, spill)
    assert m.pool.spills >= 4 and m.pool.reshared >= 2, (m.pool.spills, m.pool.reshared)
    _as_on_a_roomy_pool(invariant, more)


@pytest.mark.parametrize("invariant", [False, True])
def test_a_member_restored_beside_a_held_relative_writes_only_its_own_cells(invariant):
    """Found by the long oracle (batch-invariant mode, 256 cells): "no room to restore a spilled state of 107
    tokens". A fork family's member was restored while a relative was held by a running call beside another call:
    its whole bytes were written (the shared prefix again) before the prefix was shared and its copy dropped, so
    ~108 cells were asked where ~4 were new. Now only the member's own cells are written (``seqbytes.tail``) and the
    prefix shared first; the family continues as on a 2,048-cell pool where nothing spills, and as
    llama-cpp-python evaluates it."""
    from continuum.models.llamacpp import cells

    m = models.llamacpp(gguf("f32"), batch_invariant=invariant, n_threads=THREADS, n_ctx=256, n_seq_max=16)
    text = continuous(generate.text(m, samplers.greedy()))
    s = text("Once upon a time", max_tokens=100)
    three = continuous(generate.text(m, samplers.multinomial(3)))
    forks = three(s, max_tokens=4, rng=torch.Generator().manual_seed(0))
    first = len(row_ids(s))
    del s
    pool, seqs = m.pool, [view.seq for view in forks._kv.views]
    with m.llama.lock:
        for seq in seqs[1:]:
            pool.spill(seq)
    other = text("The cat sat on the mat", max_tokens=110)  # ~118 cells beside the resident member's ~109
    with m.llama.lock:
        pool.collect()
        assert seqs[0].id is not None and cells.free(pool) < seqs[1].extent
        pool.held = {id(seqs[0]), id(other._kv.views[0].seq)}  # (as a running step holds them)
        pool.ensure_resident(seqs[1])  # (before: KVCacheFullError, ~108 cells asked of the ~30 free)
        assert pool.reshared >= 1 and cells.used(pool) <= cells.total(pool)
        pool.held = set()
    more = three(forks, max_tokens=6, rng=torch.Generator().manual_seed(1))
    _llama_cpp_agrees(more, first, m.llama.flash_attn)
    _as_on_a_roomy_pool(invariant, more)
