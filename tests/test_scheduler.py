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
