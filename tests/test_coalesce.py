"""Calls of one generator that arrive together in ``run_batch`` programs run as one list call (loop/coalesce.py).

References: each program run alone, one after another (ids equal, weights within 1e-4), and the model's own
forward over each returned state's ids (``assert_reuse_exact``: the cache a caller gets back is its own rows').
That calls were joined is read from the module's counters; what must not be joined (a sampled draw, an
unfinished constrained step to resume, different arguments) is checked the same way, and an error in one
program's call reaches that program only.
"""

from __future__ import annotations

import pytest
from test_run_batch import same

import continuum
from continuum import continuous, generate, samplers
from continuum.errors import ContextLengthError
from continuum.loop import coalesce

from conftest import assert_reuse_exact

PROMPTS = [f"{w} {i}" for i, w in enumerate(["Once upon a time", "The dog", "She said", "Numbers: 1 2", "Le café",
                                              "Review: ok", "A tree", "Why"] * 3)]


def chain(model):
    text = continuous(generate.text(model, samplers.greedy()))
    pick = continuous(generate.choice(model, [" happy", " sad", " angry"], samplers.greedy()))
    number = continuous(generate.regex(model, r"[0-9]{2}", samplers.greedy()))

    def program(prompt: str):
        s = text(prompt, max_tokens=6)
        c = pick(s + "\nMood:")
        n = number(c + "\nAge: ", max_tokens=4)
        return s, c, n, c.value, n.value

    return program


@pytest.mark.parametrize("threads", [False, True])
def test_chains_run_as_joint_calls_and_equal_each_alone(model, threads):
    """In lockstep (the default) and with a thread per instance (``threads=True``: coalesce.run's cohorts)."""
    program = chain(model)
    solo = [program(p) for p in PROMPTS]
    coalesce.reset_stats()
    got = continuum.run_batch(program, PROMPTS, concurrency=len(PROMPTS), threads=threads)
    joined = coalesce.stats()
    assert all(same(a, b) for a, b in zip(got, solo))
    for states in got[:4]:
        for s in states[:3]:
            assert_reuse_exact(s)  # (each caller's own rows of the joint cache, nothing of the others')
    # 72 calls: three per program; joined, they take a few joint calls (how the cohorts fall depends on timing)
    assert joined["calls_joined"] >= len(PROMPTS) and joined["joint_calls"] <= 0.5 * joined["calls_joined"], joined
    assert joined["joint_failures"] == 0


def test_acalls_gathered_together_join_and_equal_each_alone(model):
    """``asyncio.gather`` of acalls (a chain of awaits per input): the calls handed to the worker pool together run
    as joint calls, and each task gets what it gets alone; a task cancelled meanwhile takes nothing from the others."""
    import asyncio

    text = continuous(generate.text(model, samplers.greedy()))
    pick = continuous(generate.choice(model, [" happy", " sad", " angry"], samplers.greedy()))

    async def program(prompt: str):
        s = await text.acall(prompt, max_tokens=6)
        return s, await pick.acall(s + "\nMood:")

    async def main():
        return await asyncio.gather(*(program(p) for p in PROMPTS))

    async def with_a_cancelled_task():
        tasks = [asyncio.ensure_future(program(p)) for p in PROMPTS[:8]]
        await asyncio.sleep(0)
        tasks[3].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    solo = [(text(p, max_tokens=6),) for p in PROMPTS]
    solo = [(s, pick(s + "\nMood:")) for (s,) in solo]
    coalesce.reset_stats()
    got = asyncio.run(main())
    joined = coalesce.stats()
    assert all(same(a, b) for a, b in zip(got, solo))
    assert joined["calls_joined"] >= len(PROMPTS) and joined["joint_calls"] <= 0.5 * joined["calls_joined"], joined
    assert_reuse_exact(got[5][1])
    rest = asyncio.run(with_a_cancelled_task())
    assert isinstance(rest[3], asyncio.CancelledError)
    assert all(same(a, b) for i, (a, b) in enumerate(zip(rest, solo)) if i != 3)


def test_a_failing_call_reaches_its_own_program_only(gpt2_model):
    """One input is too long for the model's context: the joint call fails, so each caller runs alone; that program
    gets ContextLengthError, the others what they get alone."""
    program = chain(gpt2_model)
    prompts = PROMPTS[:8] + ["word " * 400] + PROMPTS[8:16]
    coalesce.reset_stats()
    got = continuum.run_batch(program, prompts, concurrency=len(prompts), return_exceptions=True)
    assert isinstance(got[8], ContextLengthError)
    rest = [g for i, g in enumerate(got) if i != 8]
    assert all(same(a, program(p)) for a, p in zip(rest, PROMPTS[:16]))
    assert coalesce.stats()["joint_failures"] >= 1


def test_what_could_depend_on_company_runs_alone(gpt2_model):
    """A sampled draw (no rng: which rows share the random stream would change it), an unfinished regex step
    resumed by the next call (its guide state is per call) and calls with different max_tokens are not joined
    with each other; results equal each alone where they are deterministic."""
    m = gpt2_model
    sampled = continuous(generate.text(m, samplers.multinomial()))
    coalesce.reset_stats()
    continuum.run_batch(lambda p: sampled(p, max_tokens=3), PROMPTS[:8], concurrency=8)
    assert coalesce.stats()["calls_joined"] == 0

    number = continuous(generate.regex(m, r"[0-9]{6}", samplers.greedy()))

    def resumed(prompt: str):
        first = number(prompt + " n=", max_tokens=2)  # joined: nothing to resume yet
        return first, number(first, max_tokens=6)  # resumes the unfinished pattern: alone

    solo = [resumed(p) for p in PROMPTS[:8]]
    coalesce.reset_stats()
    got = continuum.run_batch(resumed, PROMPTS[:8], concurrency=8)
    assert all(same(a, b) for a, b in zip(got, solo))
    assert all(a[1].value == b[1].value for a, b in zip(got, solo))
    assert coalesce.stats()["calls_joined"] <= 8

    text = continuous(generate.text(m, samplers.greedy()))
    lengths = [2 + i % 3 for i in range(9)]
    solo_texts = [list(text(p, max_tokens=k)) for p, k in zip(PROMPTS, lengths)]
    coalesce.reset_stats()
    got_texts = continuum.run_batch(lambda i: list(text(PROMPTS[i], max_tokens=lengths[i])), range(9), concurrency=9)
    assert got_texts == solo_texts
    assert coalesce.stats()["joint_calls"] >= 3 or coalesce.stats()["calls_joined"] == 0  # (one per max_tokens at most)


@pytest.mark.parametrize("enabled", [True, False])
def test_plain_generators_and_lists_of_prompts_join_too(gpt2_model, enabled, monkeypatch):
    """Non-continuous calls (values, not states) and calls on lists of prompts: each program gets its own values,
    shaped as alone."""
    monkeypatch.setattr(coalesce, "ENABLED", enabled)
    gen = generate.text(gpt2_model, samplers.greedy())

    def program(i: int):
        return gen(PROMPTS[i], max_tokens=4), gen(PROMPTS[i:i + 1 + i % 3], max_tokens=4)

    solo = [program(i) for i in range(12)]
    assert continuum.run_batch(program, range(12), concurrency=12) == solo


def test_joint_choices_on_llama_cpp_pick_what_llama_cpp_scores_best():
    """llama.cpp's default mode (its logits depend on how tokens were batched): programs' text -> choice calls run as
    joint calls (at most the engine's 32 rows each); every pick is the option llama-cpp-python's own evaluation of
    the state's ids plus the option scores best (where the margin exceeds the decode tolerance), with its weight."""
    from test_llamacpp_choice import reference_scores

    from llamacpp_support import DECODE_TOL, fp32_model, row_ids

    m = fp32_model()
    text = continuous(generate.text(m, samplers.greedy()))
    options = [" cat", " dog", " big dog", " dragon"]
    pick = continuous(generate.choice(m, options, samplers.greedy()))

    def program(prompt: str):
        base = text(prompt, max_tokens=5) + " Then a"
        return base, pick(base)

    coalesce.reset_stats()
    got = continuum.run_batch(program, PROMPTS[:12], concurrency=12)
    assert coalesce.stats()["joint_calls"] >= 2 and coalesce.stats()["calls_joined"] >= 12
    for base, c in got:
        ref = reference_scores(m, row_ids(base), options)
        best = max(ref, key=ref.get)
        if ref[best] - sorted(ref.values())[-2] > DECODE_TOL["f32"]:
            assert c.value == best
        gain = float(c.weights[0, 0]) - float(base.weights[0, 0])  # (a state's weight sums every step's)
        assert abs(gain - ref[c.value]) < DECODE_TOL["f32"]


def test_a_thread_blocked_while_holding_the_gate_never_hangs_the_others(monkeypatch):
    """The gate (continuum's own Python, a few threads at once) is released around every wait continuum knows of;
    were a holder blocked on something else, another thread goes on without it after GATE_WAIT_S, and the gate's
    count stays whole (nothing released twice)."""
    import threading
    import time

    from continuum.loop import arrivals

    monkeypatch.setattr(arrivals, "GATE_WAIT_S", 0.2)
    gate, holding, release = arrivals.Gate(1), threading.Event(), threading.Event()

    def holder():
        with gate.held():
            holding.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    holding.wait(5)
    start = time.perf_counter()
    with gate.held():
        waited = time.perf_counter() - start
    assert 0.15 < waited < 2
    release.set()
    t.join(5)
    start = time.perf_counter()
    with gate.held(), gate.waiting():
        pass
    assert time.perf_counter() - start < 0.1  # (free again, once: the timed-out holder released nothing)
    assert gate.free() == 1


def test_a_handed_off_call_waits_for_company_briefly_while_others_keep_arriving(model):
    """On a busy server someone is nearly always arriving. A handed-off call (acall, a server request) waits for
    company at most GATHER_MAX_S (0.1 s), not a run_batch cohort's second: with an arrival every 10 ms throughout,
    a lone greedy acall still returns in well under that second, and equals the call made alone."""
    import asyncio
    import threading
    import time

    from continuum.loop.arrivals import ARRIVALS

    text = continuous(generate.text(model, samplers.greedy()))
    want = text(PROMPTS[0], max_tokens=4)
    stop = threading.Event()

    def busy():  # other clients' requests being set up, one after another: someone is always arriving
        while not stop.is_set():
            ARRIVALS.arrive()
            time.sleep(0.01)
            ARRIVALS.arrived()

    others = [threading.Thread(target=busy, daemon=True) for _ in range(2)]
    for t in others:
        t.start()
        time.sleep(0.005)
    try:
        start = time.perf_counter()
        got = asyncio.run(text.acall(PROMPTS[0], max_tokens=4))
        took = time.perf_counter() - start
    finally:
        stop.set()
        for t in others:
            t.join(5)
    assert same(got, want)
    assert took < 0.7, took  # (a run_batch cohort's leader would wait up to GATHER_S = 1 s here)
