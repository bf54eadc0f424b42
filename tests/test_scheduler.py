"""Concurrent calls on one model share forwards (continuum/loop/engine.py) and give the results of solo runs.

Every job runs alone first (the reference), then all jobs at once, one thread each, started behind a
barrier. Results must be equal: same texts and token ids, weights within 1e-4 (a merged forward sums
in another order), same choices and JSON; a multinomial call with its own rng draws what it draws alone.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_threads import comparable

from continuum import SequenceState, continuous, generate, samplers
from continuum.errors import GeneratorArgumentError, KVCacheFullError
from continuum.models.hf.cache import positions

from conftest import CORPUS, assert_reuse_exact, check_unchanged, snapshot

PROMPTS = ["Once upon a time", "The quick brown fox", "Le café est", "Numbers: 0 1 2", "She said", "Review: great"]


def concurrently(jobs, timeout: float = 120):
    """Run every job in its own thread, all released at once; results in job order."""
    barrier = threading.Barrier(len(jobs))
    results: list = [None] * len(jobs)
    errors: list = []

    def worker(i: int) -> None:
        barrier.wait(timeout=60)
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001  (re-raised in the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a concurrent call hangs"
    if errors:
        raise errors[0]
    return results


def solo_and_concurrent(model, jobs):
    solo = [job() for job in jobs]
    calls = model.forward_calls
    together = concurrently(jobs)
    return solo, together, model.forward_calls - calls


def rng(i: int) -> torch.Generator:
    return torch.Generator().manual_seed(100 + i)


def mixed_jobs(model):
    """One job per generator kind, sampler and feature; plain and continuous."""
    base = continuous(generate.text(model, samplers.greedy()))(PROMPTS[:2], max_tokens=4)
    text = generate.text(model, samplers.greedy())
    jobs = [
        lambda: text(PROMPTS[0], max_tokens=9),
        lambda: text(PROMPTS[1:3], max_tokens=3),  # different lengths
        lambda: text(PROMPTS[2], max_tokens=12, stop_at=["e", "a"]),
        lambda: generate.text(model, samplers.multinomial(2, temperature=1.3))(PROMPTS[3], max_tokens=6, rng=rng(1)),
        lambda: generate.text(model, samplers.beam_search(2))(PROMPTS[4], max_tokens=5),
        lambda: generate.text(model, samplers.greedy(), guidance_scale=3.0, negative_prompt="No")(PROMPTS[5], max_tokens=5),
        lambda: generate.text(model, samplers.greedy(), guidance_scale=2.0, cfg_mode="sequential")(PROMPTS[0], max_tokens=4),
        lambda: generate.text(model, samplers.greedy(), token_healing=True)("The quick bro", max_tokens=5),
        lambda: comparable(continuous(generate.regex(model, r"\(x[0-9]\) [a-z]{2,4}", samplers.greedy()))(
            PROMPTS[1], max_tokens=10)),
        lambda: generate.regex(model, r"[0-9]{2}-[a-z]{3}", samplers.multinomial())(PROMPTS[2], rng=rng(2)),
        lambda: generate.choice(model, ["red", "green", "blue"], samplers.greedy())(PROMPTS[3]),
        lambda: generate.choice(model, ["yes", "no"], samplers.greedy(), method="greedy")(PROMPTS[4]),
        lambda: comparable(continuous(generate.json(model, {"type": "object", "properties": {"a": {"type": "integer"}},
                                                            "required": ["a"]}, samplers.greedy()))(PROMPTS[5], max_tokens=12)),
        lambda: generate.cfg(model, 'start: "yes" | "no" | "maybe"', samplers.greedy())(PROMPTS[0]),
        # continuous states: continue, slice + text, fork into samples
        lambda: comparable(continuous(text)(base, max_tokens=3)),
        lambda: comparable(continuous(text)(base[:, :10] + " and", max_tokens=4)),
        lambda: comparable(continuous(generate.text(model, samplers.multinomial(3)))(base, max_tokens=3, rng=rng(3))),
        lambda: comparable(continuous(generate.text(model, samplers.greedy()))(base, max_tokens=0)),
    ]
    return jobs


def test_every_kind_of_call_gives_its_solo_result(model):
    jobs = mixed_jobs(model)
    solo, together, _ = solo_and_concurrent(model, jobs)
    for i, (a, b) in enumerate(zip(solo, together)):
        assert comparable(a) == comparable(b), f"job {i}"
    assert model.scheduler.stats()["merged_forwards"] > 0


def test_concurrent_calls_share_forwards(gpt2_model):
    """8 concurrent calls run in at most half the forwards of the same 8 calls one after another."""
    gen = generate.text(gpt2_model, samplers.greedy())
    jobs = [lambda p=p: gen(p, max_tokens=8) for p in PROMPTS + ["A", "Tea and"]]
    before = gpt2_model.tokens_computed
    solo = [job() for job in jobs]
    seq_forwards, seq_tokens = gpt2_model.forward_calls, gpt2_model.tokens_computed - before
    calls, tokens = gpt2_model.forward_calls, gpt2_model.tokens_computed
    together = concurrently(jobs)
    assert together == solo
    assert gpt2_model.forward_calls - calls <= (calls - seq_forwards + 8 * 8) // 2  # 8 calls x 8 forwards alone
    assert gpt2_model.tokens_computed - tokens == seq_tokens  # only each call's uncached suffix is counted


def test_states_are_immutable_and_reusable(model):
    """States a merged step returned: continuing them (alone and concurrently again) changes nothing in them,
    and their cache gives a fresh forward's logits."""
    gen = continuous(generate.text(model, samplers.greedy()))
    states = concurrently([lambda p=p: gen(p, max_tokens=5) for p in PROMPTS])
    snaps = [snapshot(s) for s in states]
    for s in states:
        assert_reuse_exact(s)
    again = concurrently([lambda s=s: gen(s, max_tokens=4) for s in states] + [lambda s=s: gen(s, max_tokens=2) for s in states])
    alone = [gen(s, max_tokens=4) for s in states] + [gen(s, max_tokens=2) for s in states]
    assert [comparable(a) for a in again] == [comparable(b) for b in alone]
    for s, snap in zip(states, snaps):
        check_unchanged(s, snap)
    for s in again:
        assert_reuse_exact(s)


def test_a_stream_closed_early_leaves_the_batch(gpt2_model):
    gen = generate.text(gpt2_model, samplers.greedy())

    def reader():
        out = []
        for i, text in enumerate(gen.stream(PROMPTS[0], max_tokens=20)):
            out.append(text)
            if i == 2:
                break  # the generator is closed here: its loop must leave the batch
        return out

    jobs = [reader] + [lambda p=p: gen(p, max_tokens=10) for p in PROMPTS[1:4]]
    solo, together, _ = solo_and_concurrent(gpt2_model, jobs)
    assert together == solo
    sched = gpt2_model.scheduler
    assert not sched._running and not sched._inbox  # nobody left registered


def test_two_streams_interleaved_in_one_thread(gpt2_model):
    """A loop parked at a yield is not waited for: one thread can step two streams in turn."""
    gen = generate.text(gpt2_model, samplers.greedy())
    a, b = gen.stream(PROMPTS[0], max_tokens=5), gen.stream(PROMPTS[1], max_tokens=5)
    got = ["", ""]
    for x, y in zip(a, b):  # both streams take 5 steps (greedy, no EOS in this tiny vocabulary's top choices)
        got = [got[0] + x, got[1] + y]
    assert got == [gen(PROMPTS[0], max_tokens=5), gen(PROMPTS[1], max_tokens=5)]


def test_admission_bound_makes_calls_wait_not_fail(gpt2_model):
    sched = gpt2_model.scheduler
    old = sched.max_rows
    sched.max_rows = 2
    sched.reset_stats()
    try:
        gen = generate.text(gpt2_model, samplers.greedy())
        jobs = [lambda p=p: gen(p, max_tokens=4) for p in PROMPTS]
        solo, together, _ = solo_and_concurrent(gpt2_model, jobs)
        assert together == solo
        assert sched.stats()["peak_rows"] <= 2
    finally:
        sched.max_rows = old


def test_kv_budget_makes_calls_wait_not_fail(gpt2_model):
    """``engine.max_kv_bytes`` (the model's ``kv_budget``: one setting): calls whose KV (at their longest) would exceed
    the budget wait for room; a call larger than the budget alone is refused before it runs; results equal solo
    runs; nothing is left counted."""
    from continuum.models.memory import kv_bytes

    engine = gpt2_model.engine
    gen = generate.text(gpt2_model, samplers.greedy())
    one = kv_bytes(gpt2_model, len(gpt2_model.tokenizer.encode_prompts([PROMPTS[0]])[0]) + 4)
    saved = engine.max_kv_bytes
    try:
        engine.max_kv_bytes = int(2.5 * one)  # about two of these calls at once
        engine.reset_stats()
        jobs = [lambda p=p: gen(p, max_tokens=4) for p in PROMPTS]
        solo, together, _ = solo_and_concurrent(gpt2_model, jobs)
        assert together == solo
        assert engine.stats()["peak_rows"] <= 3
        engine.max_kv_bytes = one // 2  # smaller than any call: refused at once, the model's kv_budget says so
        assert gpt2_model.kv_budget == one // 2
        with pytest.raises(KVCacheFullError, match="kv_budget"):
            gen(PROMPTS[1], max_tokens=4)
        assert engine.stats()["running_kv_bytes"] == 0
    finally:
        engine.max_kv_bytes = saved
    for name, bad in [("max_kv_bytes", -1), ("max_kv_bytes", "1 GiB"), ("max_rows", 0), ("max_rows", None),
                      ("prefill_chunk", 0), ("prefill_chunk", 2.5)]:
        before = getattr(engine, name)
        with pytest.raises(GeneratorArgumentError, match=name):  # at once, not later inside a step
            setattr(engine, name, bad)
        assert getattr(engine, name) == before


def test_an_error_in_one_request_reaches_only_its_owner(gpt2_model):
    """A bad forward merged with good ones: the merged forward fails, each request is rerun alone."""
    gen = generate.text(gpt2_model, samplers.greedy())
    V = gpt2_model.vocab_size

    def bad():
        ids = torch.tensor([[V + 5]])
        mask = torch.ones_like(ids)
        for _ in range(6):
            try:
                gpt2_model.forward(ids, mask, positions(mask), None)
            except (IndexError, RuntimeError):
                continue
            return "no error"
        return "raised"

    jobs = [lambda p=p: gen(p, max_tokens=6) for p in PROMPTS[:3]] + [bad]
    solo = [job() for job in jobs[:3]]
    together = concurrently(jobs)
    assert together[:3] == solo and together[3] == "raised"


def test_padding_is_reported_and_bounded(gpt2_model):
    sched = gpt2_model.scheduler
    sched.reset_stats()
    gen = generate.text(gpt2_model, samplers.greedy())
    prompts = [CORPUS[i][:40] for i in (0, 1, 6, 7, 8)]  # similar lengths (ASCII): little left padding, as in a list call
    concurrently([lambda p=p: gen(p, max_tokens=12) for p in prompts])
    stats = sched.stats()
    # Released together, the calls still reach their first forward at times the OS decides: one that
    # joins after the others generated a few tokens is left-padded to their width (measured here: 1.1-1.6
    # on a loaded machine). 2 bounds that skew; the 1.5 target is the benchmarks' (B15-B20 report it).
    assert stats["merged_forwards"] > 0 and 1.0 <= stats["peak_padding"] < 2.0
    assert stats["p99_step_wait_s"] >= 0.0


def test_a_lone_call_never_touches_merged_storage(gpt2_model):
    """Alone, a call runs its forward directly: its state's cache is the usual arena, not a slab."""
    from continuum.models.hf.slab import slot_of
    from continuum.models.hf.tensorkv import layers_of

    state = continuous(generate.text(gpt2_model, samplers.greedy()))(PROMPTS[0], max_tokens=4)
    assert isinstance(state, SequenceState) and slot_of(layers_of(state._kv)) is None


def test_in_batch_prefix_sharing_computes_a_shared_prefix_once(bpe_tokenizer):
    """Prefix cache on: calls sharing a prefix that arrive together compute it once (one waits for the other's blocks)."""
    from continuum import models

    from conftest import tiny_gpt2

    hf = tiny_gpt2(len(bpe_tokenizer), n_positions=512)
    model = models.Transformers(hf, bpe_tokenizer, prefix_cache="64MiB")
    shared = " ".join(CORPUS[:3])[:150]
    prompts = [shared + tail for tail in (" Q: one?", " Q: two?", " Q: three?", " Q: four?")]
    gen = generate.text(model, samplers.greedy())
    prefix = len(model.tokenizer.encode_prompts([shared])[0])
    assert prefix >= 3 * model.prefix_cache.block_size

    def computed(run):
        model.prefix_cache.clear()
        before = model.tokens_computed
        out = run()
        return out, model.tokens_computed - before

    solo, solo_tokens = computed(lambda: [gen(p, max_tokens=3) for p in prompts])
    together, together_tokens = computed(lambda: concurrently([lambda p=p: gen(p, max_tokens=3) for p in prompts]))
    assert together == solo
    assert together_tokens == solo_tokens  # the shared prefix computed once, as one call after another does
    assert together_tokens < len(prompts) * prefix


def test_programs_with_chained_calls_join_and_leave_at_every_step(model):
    """Programs of several chained calls (continue, slice, fork, choose) of different lengths: calls join and
    leave the merged batch at many steps (spare rows, dead rows, new slabs); every program gives its solo result."""
    text = continuous(generate.text(model, samplers.greedy()))
    sampled = continuous(generate.text(model, samplers.multinomial(2)))
    pick = generate.choice(model, [" yes", " no"], samplers.greedy())

    def program(i: int):
        s = text(PROMPTS[i % len(PROMPTS)], max_tokens=2 + i % 4)
        s = text(s + " then", max_tokens=1 + (i * 3) % 5)
        forks = sampled(s[..., : max(1, len(str(s)) - 3)], max_tokens=3, rng=rng(i))
        return comparable(s), comparable(forks), pick(str(s) + "?")

    jobs = [lambda i=i: program(i) for i in range(8)]
    solo, together, _ = solo_and_concurrent(model, jobs)
    assert together == solo
    stats = model.scheduler.stats()
    assert stats["merged_forwards"] > 0 and stats["fallbacks"] == 0



def test_a_kv_budget_on_transformers_bounds_the_running_calls_and_refuses_only_what_never_fits(gpt2_model):
    """``models.transformers(..., kv_budget=...)``: run_batch beyond the budget completes, each program equal to
    itself alone, the running calls' KV (each at its longest) never above the budget; a call that alone would
    exceed it is refused before anything runs, and the model works after."""
    from continuum import models, run_batch
    from continuum.errors import KVCacheFullError
    from continuum.models.memory import kv_bytes

    one = kv_bytes(gpt2_model, len(gpt2_model.tokenizer.encode_prompts([PROMPTS[0]])[0]) + 8)
    budget = int(2.5 * one)
    model = models.Transformers(gpt2_model.model, gpt2_model.tokenizer, kv_budget=budget)
    assert model.engine.max_kv_bytes == budget
    gen = generate.text(model, samplers.greedy())
    alone = [gen(p, max_tokens=8) for p in PROMPTS]
    model.engine.reset_stats()
    assert run_batch(lambda p: gen(p, max_tokens=8), PROMPTS * 2) == alone * 2
    assert 0 < model.engine.stats()["peak_running_kv_bytes"] <= budget
    with pytest.raises(KVCacheFullError, match="kv_budget"):
        gen(PROMPTS[0], max_tokens=500)
    assert gen(PROMPTS[0], max_tokens=8) == alone[0] and model.engine.stats()["running_kv_bytes"] == 0
    with pytest.raises(ValueError, match="kv_budget"):
        models.Transformers(gpt2_model.model, gpt2_model.tokenizer, kv_budget="lots")



def test_a_list_call_beyond_the_kv_budget_runs_in_parts_and_only_beams_that_never_fit_are_refused(gpt2_model):
    """Nothing refused that fits: six prompts on a budget of 2.5 rows were refused as one list call
    (``KVCacheFullError``) while run_batch of the same programs ran. Now the prompts run in parts (each equal to the
    prompt alone, the running KV within the budget), a fresh ``multinomial(6)`` draws its samples in groups (each
    sample's weight the log-prob a fresh forward gives its tokens), and only a prompt's beams, which advance together,
    are refused."""
    from continuum import models
    from continuum.models.memory import kv_bytes

    tok = gpt2_model.tokenizer
    one = kv_bytes(gpt2_model, max(len(ids) for ids in tok.encode_prompts(PROMPTS)) + 8)
    model = models.Transformers(gpt2_model.model, tok, kv_budget=int(2.5 * one))
    text = continuous(generate.text(model, samplers.greedy()))
    alone = [text(p, max_tokens=8) for p in PROMPTS]
    model.engine.reset_stats()
    together = text(PROMPTS, max_tokens=8)
    assert list(together) == [str(a) for a in alone]
    for b, a in enumerate(alone):
        assert abs(float(together.weights[b, 0]) - float(a.weights[0, 0])) < 1e-4
    assert 0 < model.engine.stats()["peak_running_kv_bytes"] <= model.kv_budget
    draws = continuous(generate.text(model, samplers.multinomial(6)))(PROMPTS[0], max_tokens=8,
                                                                     rng=torch.Generator().manual_seed(0))
    assert draws.samples == 6
    n = len(tok.encode_prompts([PROMPTS[0]])[0])
    for i in range(6):
        ids = draws.token_ids[i][draws.attention_masks[i].bool()]
        with torch.no_grad():
            lp = torch.log_softmax(gpt2_model.model(ids[None]).logits[0].float(), -1)
        ref = sum(float(lp[j - 1, ids[j]]) for j in range(n, len(ids)))
        assert abs(float(draws.weights[0, i]) - ref) < 1e-4
    with pytest.raises(KVCacheFullError, match="beams"):
        generate.text(model, samplers.beam_search(4))(PROMPTS[0], max_tokens=8)
    assert text(PROMPTS[0], max_tokens=8).value == alone[0].value


def test_a_kv_budget_counts_the_step_as_it_is_laid_out(gpt2_model):
    """One long document decoding, then ten short calls: each short call at its own length fits the budget beside it,
    but the decode step holds every row as long as the longest (one slab). Before, all ten joined the long call (11
    rows as long as the document: ~3.7x the budget); now at most two do while it runs (the slab, rows x the longest,
    fits). Results equal each call alone."""
    import threading
    import time

    from continuum import models
    from continuum.models.memory import kv_bytes

    tok = gpt2_model.tokenizer
    long_doc = " ".join(f"w{i}" for i in range(25))  # (the tiny model has 256 positions)
    short = [f"Hi {i}" for i in range(10)]
    budget = 3 * kv_bytes(gpt2_model, len(tok.encode_prompts([long_doc])[0]) + 150)  # the long call and two short ones
    model = models.Transformers(gpt2_model.model, gpt2_model.tokenizer, kv_budget=budget)
    gen = generate.text(model, samplers.greedy())
    alone = [gen(long_doc, max_tokens=150)] + [gen(p, max_tokens=4) for p in short]
    model.engine.reset_stats()
    out: dict[int, str] = {}

    def run(i: int):
        out[i] = gen(long_doc, max_tokens=150) if i == 0 else gen(short[i - 1], max_tokens=4)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(11)]
    threads[0].start()
    while not model.engine.stats()["running_calls"]:  # (the long call decodes; the short ones arrive beside it)
        time.sleep(0.001)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(60)
    assert [out[i] for i in range(11)] == alone
    stats = model.engine.stats()
    assert stats["peak_rows"] <= 3 and stats["peak_running_kv_bytes"] <= budget, stats


def test_a_slab_is_laid_out_again_when_its_long_call_leaves():
    """models/hf/merge.plan: a slab keeps the width of the longest call that was in it; when that call leaves (one dead
    row among eight live ones: few enough to keep the slab), the short calls still decoding in it are laid out again at
    their own width, else every row pays the long call's columns, which the kv_budget's count (Scheduler.slab_bytes)
    prices at the live calls' width. The layout is checked on merge.plan itself: which slab, how many columns."""
    from continuum.models.hf import merge
    from continuum.models.hf.slab import Slab, SlabView
    from continuum.models.hf.tensorkv import TensorKV
    from continuum.models.request import Request

    slab = Slab(layers=1, rows_cap=12, cols_cap=400)
    slab.keys[0], slab.values[0] = torch.zeros(12, 1, 400, 2), torch.zeros(12, 1, 400, 2)
    slab.end, slab.rows_used = 300, 9  # row 0: the long call (300 columns), gone; rows 1-8: calls of 10 columns

    def short(row: int, width: int) -> Request:
        return Request(ids=torch.ones(1, 1, dtype=torch.long), mask=torch.ones(1, width + 1, dtype=torch.long),
                       pos=torch.full((1, 1), width), kv=TensorKV(SlabView((slab, row, 1, slab.end - width), width)))

    p = merge.plan([short(r, 10) for r in range(1, 9)], layers=1)
    assert p.slab is not slab and p.fresh and p.cached == 10  # laid out again at the calls' own width
    p = merge.plan([short(r, 250) for r in range(1, 9)], layers=1)
    assert p.slab is slab and not p.fresh and p.cached == 300  # (a slab about as wide as its calls is kept: no copy)


@pytest.mark.parametrize("mode", ["batched", "sequential"])
def test_guidance_calls_go_through_admission(gpt2_model, mode):
    """Issue 56: classifier-free guidance's loop ran in its caller's thread, its forwards one-off requests, so its
    call was never admitted: three CFG calls on a 2-row bound ran all at once (6 rows in one forward). Now both
    branches' forwards are the call's own requests: a call of 1 prompt counts 2 rows, so they run one at a time
    (no forward holds more than 2 rows), each result as alone."""
    sched = gpt2_model.scheduler
    old = sched.max_rows
    gen = generate.text(gpt2_model, samplers.greedy(), guidance_scale=2.0, negative_prompt="The cat", cfg_mode=mode)
    jobs = [lambda p=p: gen(p, max_tokens=6) for p in PROMPTS[:3]]
    sizes: list[int] = []
    real_run = gpt2_model._run

    def spy(ids, mask, pos, past, logits, allowed=None, outputs=None):
        sizes.append(ids.shape[0])
        return real_run(ids, mask, pos, past, logits, allowed, outputs)

    sched.max_rows = 2
    gpt2_model._run = spy
    try:
        solo, together, _ = solo_and_concurrent(gpt2_model, jobs)
    finally:
        sched.max_rows = old
        del gpt2_model._run
    assert together == solo
    assert max(sizes) <= 2, sizes
