"""Spilled states on a llama.cpp pool (continuum/models/llamacpp/pool.py, reshare.py, window.py): idle states past the
budget spill oldest first; a spilled fork family restores sharing its prefix again; bytes cut back are llama.cpp's own
bytes of the cut sequence; short views restore only their own positions. Every continuation is checked against
llama-cpp-python's own evaluation of the same ids (tests/test_llamacpp_pool.py: the pool under pressure).
"""

from __future__ import annotations

import pytest
import torch
from test_llamacpp_pool import THREADS, WORDS  # (one llama.cpp thread: why, there)

from continuum import continuous, generate, models, samplers

from llamacpp_support import DECODE_TOL, check_greedy_path, gemma_path, gguf, reference_logits, row_ids


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
