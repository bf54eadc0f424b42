"""What the engine admits to a step, and when (continuum/loop/engine.py, loop/arrivals.py): a step waits only for calls
being set up; calls started together prefill together; a long prompt arriving mid-run is prefilled in chunks; the
gate lets few callers run their own Python; a one-off request whose step raises gets an error; a cut of a merged
result attends only to its own columns. References as in tests/test_engine_step.py: the same calls run alone.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_engine_step import WORDS, numbered_prompts
from test_scheduler import PROMPTS

import continuum
from continuum import continuous, generate, samplers
from continuum.models.request import Request

from conftest import assert_reuse_exact, chars_key


def test_a_step_waits_for_calls_being_set_up_and_for_nobody_else(gpt2_model):
    """continuum/loop/arrivals.py: while another thread sets up a call, the step about to run waits for it
    (at most the last step's time), and goes on as soon as that setup is over; with nobody arriving it
    does not wait; every kind of call, failing ones and closed streams included, leaves nobody counted
    (a count left behind would make every later step wait)."""
    arrivals = gpt2_model.engine.arrivals
    assert arrivals.count == 0
    t0 = time.perf_counter()
    arrivals.gather(last_step_s=0.5)
    assert time.perf_counter() - t0 < 0.05  # nobody arriving: no wait

    started, release = threading.Event(), threading.Event()

    def setting_up():
        arrivals.arrive()
        started.set()
        release.wait(5)
        arrivals.arrived()

    th = threading.Thread(target=setting_up)
    th.start()
    started.wait(5)
    t0 = time.perf_counter()
    arrivals.gather(last_step_s=0.01)  # bounded by the last step's time
    waited = time.perf_counter() - t0
    assert 0.008 <= waited < 0.5, waited
    threading.Timer(0.005, release.set).start()
    t0 = time.perf_counter()
    arrivals.gather(last_step_s=0.015)  # the setup ends after ~5 ms: the wait ends with it (or at its deadline)
    assert time.perf_counter() - t0 < 0.5
    th.join(5)
    assert arrivals.count == 0

    gen = generate.text(gpt2_model, samplers.greedy())
    gen(PROMPTS[0], max_tokens=0)
    generate.choice(gpt2_model, ["yes", "no"], samplers.greedy())(PROMPTS[:2])
    generate.text(gpt2_model, samplers.greedy(), guidance_scale=2.0, negative_prompt="bad")(PROMPTS[0], max_tokens=3)
    stream = gen.stream(PROMPTS[0], max_tokens=8)
    next(stream)
    del stream
    with pytest.raises(continuum.ContinuumError):
        gen(PROMPTS[0], max_tokens=3, rng="not a generator")  # (raised inside the call's setup)
    continuum.run_batch(lambda p: gen(p, max_tokens=4), PROMPTS, concurrency=8)
    assert arrivals.count == 0


def test_calls_started_together_prefill_together(model):
    """32 one-call programs started at once by run_batch reach the engine in a few steps (their setups are
    waited for), not one cohort per step: the steps stay close to the tokens of one call."""
    gen = generate.text(model, samplers.greedy())
    prompts = numbered_prompts(32)
    gen(prompts[0], max_tokens=2)
    model.engine.reset_stats()
    continuum.run_batch(lambda p: gen(p, max_tokens=12), prompts, concurrency=32)
    stats = model.engine.stats()
    assert stats["steps"] <= 12 + 6, stats


def test_a_long_prompt_arriving_while_others_run_is_prefilled_in_chunks(model):
    """A call whose uncached suffix is longer than ``engine.prefill_chunk`` and that arrives while another
    call runs is prefilled a chunk per step (no forward of the step holds more new columns than the chunk),
    computes each of its prompt's positions once, and both results equal their solo runs; alone, the same
    call prefills in one forward."""
    gen = generate.text(model, samplers.greedy())
    long_prompt = " ".join(f"{WORDS[i % len(WORDS)]} {i}" for i in range(12))
    n = len(model.tokenizer.encode_prompts([long_prompt])[0])
    assert n > 3 * 16
    solo_long, solo_short = gen(long_prompt, max_tokens=6), gen(PROMPTS[0], max_tokens=24)
    engine = model.engine
    widths: list[int] = []
    run = model._run

    def recording(ids, *args, **kwargs):
        widths.append(ids.shape[1])
        return run(ids, *args, **kwargs)

    saved = engine.prefill_chunk
    try:
        engine.prefill_chunk = 16
        model._run = recording
        stream = gen.stream(PROMPTS[0], max_tokens=24)  # driven by the engine's thread: running meanwhile
        first = next(stream)
        before = model.tokens_computed
        widths.clear()
        got_long = gen(long_prompt, max_tokens=6)
        computed = model.tokens_computed - before
        got_short = first + "".join(stream)
    finally:
        engine.prefill_chunk = saved
        del model._run
    assert got_long == solo_long and got_short == solo_short
    assert max(widths) <= 16, widths  # no step held the whole prompt
    assert widths.count(16) >= (n - 1) // 16  # the prompt went through in chunks
    assert computed >= n  # each prompt position computed (once; the other call's steps add their own)
    widths.clear()
    model._run = recording
    try:
        gen(long_prompt, max_tokens=1)  # alone: one forward for the prompt
    finally:
        del model._run
    assert widths[0] == n, widths


def test_the_gate_lets_few_callers_run_their_own_python_and_frees_itself_while_they_wait():
    """continuum/loop/arrivals.py ``Gate``: at most ``width`` threads inside ``held()`` at once (reentrant);
    a holder waiting (``waiting()``) lets another in; every thread gets through."""
    from continuum.loop.arrivals import Gate

    gate = Gate(width=2)
    inside, peak, lock = [0], [0], threading.Lock()
    release = threading.Event()

    def worker(wait_inside: bool):
        with gate.held(), gate.held():  # (reentrant: one slot)
            with lock:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
            if wait_inside:
                with lock:
                    inside[0] -= 1
                with gate.waiting():  # off the gate while waiting
                    release.wait(5)
                with lock:
                    inside[0] += 1
                    peak[0] = max(peak[0], inside[0])
            time.sleep(0.005)
            with lock:
                inside[0] -= 1

    waiters = [threading.Thread(target=worker, args=(True,)) for _ in range(2)]
    for t in waiters:
        t.start()
    time.sleep(0.05)  # both wait inside, off the gate: the others still get in
    others = [threading.Thread(target=worker, args=(False,)) for _ in range(6)]
    for t in others:
        t.start()
    for t in others:
        t.join(5)
    assert not any(t.is_alive() for t in others)
    release.set()
    for t in waiters:
        t.join(5)
    assert not any(t.is_alive() for t in waiters)
    assert inside[0] == 0 and peak[0] == 2  # never more than 2 running inside the gate (and 2 did at once)


def _until(condition, timeout: float = 10.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


def test_a_one_off_request_whose_step_raises_gets_an_error_instead_of_waiting_forever(bpe_tokenizer, monkeypatch):
    """A ``max_tokens=0`` prefill (a one-off request, ``Engine.forward``) made while another call drives the engine
    joins that call's next step; that step raises (injected into the model's ``run_step``). The one-off request
    has left the inbox at admission: its caller must get an error at once, not wait on its event forever."""
    from conftest import tiny_gpt2

    model = continuum.models.Transformers(tiny_gpt2(len(bpe_tokenizer)), bpe_tokenizer)  # (its own engine)
    engine, real = model.engine, model.run_step
    first = [True]

    def run_step(batch, stats):
        if any(r.event is not None for r in batch):  # the step holding the one-off request fails
            raise RuntimeError("injected failure of the step")
        if first.pop() if first else False:  # the driver's first step waits for the one-off request: its next admits it
            assert _until(lambda: any(isinstance(x, Request) for x in engine._inbox)), "the one-off request never came"
        return real(batch, stats)

    monkeypatch.setattr(model, "run_step", run_step)
    text = generate.text(model, samplers.greedy())
    outcome: dict = {}

    def record(name, job):
        try:
            outcome[name] = job()
        except Exception as exc:  # noqa: BLE001  (checked below)
            outcome[name] = exc

    driver = threading.Thread(target=record, args=("driver", lambda: text("Once upon a time", max_tokens=20)), daemon=True)
    driver.start()
    assert _until(lambda: engine._driver is not None)
    prefill = lambda: continuous(generate.text(model, samplers.greedy()))("The dog", max_tokens=0)  # noqa: E731
    oneoff = threading.Thread(target=record, args=("oneoff", prefill), daemon=True)  # (a regression hangs: daemon)
    oneoff.start()
    oneoff.join(timeout=10)
    assert not oneoff.is_alive(), "the one-off request's caller waits forever"
    assert isinstance(outcome["oneoff"], continuum.errors.ContinuumError)
    assert "injected failure of the step" in str(outcome["oneoff"])
    driver.join(timeout=20)
    assert isinstance(outcome.get("driver"), RuntimeError)  # the driver's own call gets the step's error
    monkeypatch.undo()
    assert text("The dog", max_tokens=4) == generate.text(model, samplers.greedy())("The dog", max_tokens=4)  # usable


def test_a_cut_of_a_merged_result_attends_only_to_the_columns_it_kept(model):
    """Issue 56 (an oracle finding): a result of a merged forward is a view of the slab's rows, and the slab keeps
    those rows' attention mask from step to step. A character cut that masks some rows' cached tokens but keeps the
    last cached column kept the very same tensors, so continuing it was taken for a slab member in place and
    attended to the cut tokens through the slab's old mask (log-probs 0.05 off on a tiny Llama). Reference: a fresh
    forward of the HF model over the cut's tokens (``assert_reuse_exact``), and greedy continuation's log-probs."""
    from continuum.models.hf.slab import slot_of
    from continuum.models.hf.tensorkv import layers_of

    text = continuous(generate.text(model, samplers.greedy()))
    fork = continuous(generate.text(model, samplers.multinomial(3)))
    prompts = [f"{w} {i}" for i, w in enumerate(WORDS[:2])]
    results = []
    for seed in range(8):  # a fork merged with a short call: its result keeps the slab's rows (compact() keeps a
        # view whose storage is not much bigger than itself)
        rng = torch.Generator().manual_seed(seed)
        results += continuum.run_batch(lambda job: job(), [lambda rng=rng: fork(prompts, max_tokens=4, rng=rng),
                                                           lambda: text(prompts, max_tokens=2)], concurrency=2)
    tested = 0
    for state in results:
        if slot_of(layers_of(state._kv)) is None:  # (not a slab view: a result the slab did not hand out)
            continue
        n = min(len(t) for t in state)  # the shortest row keeps every cached token; longer rows lose some
        cut = state[chars_key(state, slice(None, n))]
        if cut._mask[:, :cut._kv.length()].all():
            continue  # nothing cached was masked
        tested += 1
        assert_reuse_exact(cut)
        more = (fork if cut.samples > 1 else text)(cut, max_tokens=3, rng=torch.Generator().manual_seed(0))
        for before, ids, mask, lps in zip(cut.attention_masks, more.token_ids, more.attention_masks, more.token_logprobs):
            real, lp, start = ids[mask.bool()], lps[mask.bool()].double(), int(before.sum())
            with torch.no_grad():
                ref = model.model(input_ids=real[None]).logits[0].double().log_softmax(-1)
            new = torch.arange(start, len(real))  # the continuation's tokens
            torch.testing.assert_close(lp[new], ref[new - 1, real[new]], atol=1e-4, rtol=0)
    assert tested >= 2, "no merged result was cut inside its cache: the test checks nothing"
