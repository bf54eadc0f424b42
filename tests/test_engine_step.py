"""One engine per model runs every call's loop (continuum/loop/engine.py): what issue 29 asks of it.

References are the same calls run alone (and one list call over the same prompts), on GPT-2 and Llama
shapes: ids equal, weights within 1e-4. The engine's own promises are checked structurally: each
waiting caller is woken once (its event set once, its wait returning once), an idle engine burns no
CPU, an error in one call's loop reaches that caller only, and a call joining a beam search mid-way
changes neither result.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from test_scheduler import PROMPTS, concurrently, mixed_jobs
from test_threads import comparable

import continuum
from continuum import continuous, generate, samplers
from continuum.loop import coalesce
from continuum.loop import engine as engine_module

WORDS = ["Once upon a time", "The dog", "She said", "Numbers: 1 2", "Le café", "Review: ok", "A tree", "Why"]


def numbered_prompts(n: int) -> list[str]:
    return [f"{WORDS[i % len(WORDS)]} {i}" for i in range(n)]


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "engine-merged"])
def test_one_call_programs_equal_one_list_call_and_share_every_step(model, joined, monkeypatch):
    """32 one-call programs under run_batch: each equals its row of one list call, and the engine ran
    them in about as many steps as one call takes (not one forward per program per token): joined into
    list calls (loop/coalesce.py), or each its own loop, the engine merging their forwards."""
    monkeypatch.setattr(coalesce, "ENABLED", joined)
    prompts = numbered_prompts(32)
    text = continuous(generate.text(model, samplers.greedy()))
    listed = text(prompts, max_tokens=12)
    model.engine.reset_stats()
    each = continuum.run_batch(lambda p: text(p, max_tokens=12), prompts, concurrency=32)
    stats = model.engine.stats()
    for i, state in enumerate(each):
        row = listed[i, :]
        assert list(state) == list(row), i
        assert state.token_ids[0, -12:].tolist() == row.token_ids[0, -12:].tolist(), i
        assert torch.allclose(state.weights, row.weights, atol=1e-4), i
    assert stats["steps"] <= 12 + 16, stats  # one step per token for all (plus the ramp while programs start)
    assert stats["merged_forwards"] + stats["alone"] <= 12 + 16 and stats["fallbacks"] == 0, stats
    if not joined:
        assert stats["merged_forwards"] >= 12, stats


def test_every_kind_of_call_in_one_engine_equals_its_solo_run_from_asyncio(model):
    """The mixed workload of test_scheduler (every generator kind, sampler, CFG, healing, fast-forward,
    continuous states), from asyncio tasks instead of threads."""
    import asyncio

    jobs = mixed_jobs(model)
    solo = [comparable(job()) for job in jobs]

    async def main():
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.run_in_executor(None, job) for job in jobs))

    together = asyncio.run(main())
    assert [comparable(t) for t in together] == solo


class _Counting(threading.Event):
    """An event that counts how often it is set and how often a waiter returns from it."""

    def __init__(self):
        super().__init__()
        self.sets = self.returns = 0

    def set(self):
        self.sets += 1
        super().set()

    def wait(self, timeout=None):
        out = super().wait(timeout)
        self.returns += 1
        return out


def test_a_waiting_caller_is_woken_once_not_per_step(gpt2_model, monkeypatch):
    events: list[_Counting] = []
    real_init = engine_module.Call.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.event = _Counting()
        events.append(self.event)

    monkeypatch.setattr(engine_module.Call, "__init__", init)
    gen = generate.text(gpt2_model, samplers.greedy())
    gpt2_model.engine.reset_stats()
    out = concurrently([lambda p=p: gen(p, max_tokens=16) for p in PROMPTS])
    assert out == [gen(p, max_tokens=16) for p in PROMPTS]
    steps = gpt2_model.engine.stats()["steps"]
    assert steps >= 16 and len(events) >= 2 * len(PROMPTS)
    assert all(e.sets == 1 for e in events), [e.sets for e in events]  # done once: the one wake-up
    assert all(e.returns <= 1 for e in events), [e.returns for e in events]  # a waiter returns once (a driver never waits)


def test_an_idle_engine_takes_no_cpu_and_its_thread_leaves(gpt2_model):
    """Streams are driven by the engine's own thread. Idle, it takes no CPU, and it leaves (a live thread that computed
    keeps an OpenMP team that slows every other thread's operations: loop/driving.Driving._serve); the next streams
    start another, with the same results."""
    gen = generate.text(gpt2_model, samplers.greedy())
    streams = [lambda p=p: "".join(gen.stream(p, max_tokens=4)) for p in PROMPTS[:3]]
    first = concurrently(streams)  # streams: the engine's thread
    engine = gpt2_model.engine
    thread = engine._thread
    assert thread is not None  # (it ran them)
    time.sleep(0.2)
    before = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - before < 0.05  # nothing polls
    assert not thread.is_alive() and engine._thread is None  # it left once idle
    assert concurrently(streams, timeout=60) == first  # (nobody drove them: a timeout)


def test_a_thread_that_hands_its_calls_over_computes_on_one_thread():
    """acall's workers, a server's request threads and run_batch's call threads never drive the engine
    (``never_drive``); their own tensor operations run on one thread, so they make no OpenMP team beside the
    computing thread's (loop/omp.py), while the other threads keep their setting."""
    from continuum.loop import omp
    from continuum.loop.driving import never_drive

    if omp._runtime() is None:
        pytest.skip("no OpenMP runtime found in this process (not Linux, or torch without OpenMP): nothing to set")
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # (whatever an earlier test left: a thread that computes in parallel)
    seen: dict = {}

    def worker() -> None:
        seen["before"] = torch.get_num_threads()
        never_drive()
        seen["after"] = torch.get_num_threads()
        seen["value"] = torch.log_softmax(torch.arange(8 * 65536, dtype=torch.float32).reshape(8, -1), -1)

    try:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert seen["before"] == torch.get_num_threads() == 2 and seen["after"] == 1
        x = torch.arange(8 * 65536, dtype=torch.float32).reshape(8, -1)
        assert torch.equal(seen["value"], torch.log_softmax(x, -1))  # (the same values, computed on one thread)
    finally:
        torch.set_num_threads(before)


class _Exploding:
    """A guide that fails at its third mask: a bug in one call's constraint, mid-batch."""

    def __init__(self, guide):
        self._guide, self.calls = guide, 0
        self.key, self.copy_free = guide.key + "+exploding", guide.copy_free

    def __getattr__(self, name):
        return getattr(self._guide, name)

    def apply_mask(self, logprobs, states):
        self.calls += 1
        if self.calls == 3:
            raise ValueError("guide state broken at step 3")
        return self._guide.apply_mask(logprobs, states)


def test_a_call_whose_loop_raises_mid_batch_fails_alone(model):
    text = generate.text(model, samplers.greedy())
    bad = copy.copy(generate.regex(model, r"[a-z ]{4,12}", samplers.greedy(), fast_forward=False))
    bad.guide = _Exploding(bad.guide)
    prompts = numbered_prompts(16)
    solo = [text(p, max_tokens=8) for p in prompts]

    def run_bad():
        try:
            bad(PROMPTS[0], max_tokens=8)
        except ValueError as exc:
            return str(exc)
        return "no error"

    together = concurrently([run_bad] + [lambda p=p: text(p, max_tokens=8) for p in prompts])
    assert together[0] == "guide state broken at step 3"
    assert together[1:] == solo
    assert text(prompts[0], max_tokens=8) == solo[0]  # the model stays usable
    assert model.engine.stats()["running_calls"] == 0


def test_a_call_joining_a_beam_search_mid_way_changes_neither(model):
    beam = continuous(generate.text(model, samplers.beam_search(3)))
    text = continuous(generate.text(model, samplers.greedy()))
    alone_beam, alone_text = beam(PROMPTS[0], max_tokens=14), text(PROMPTS[1], max_tokens=6)
    engine = model.engine
    started = threading.Event()
    results: dict = {}

    def run_beam():
        results["beam"] = beam(PROMPTS[0], max_tokens=14)

    real_step = engine._step

    def step():
        real_step()
        if engine.stats()["steps"] >= 4:
            started.set()

    engine._step = step  # type: ignore[method-assign]
    try:
        engine.reset_stats()
        t = threading.Thread(target=run_beam)
        t.start()
        assert started.wait(60)
        results["text"] = text(PROMPTS[1], max_tokens=6)  # joins at the beam's next step
        t.join(60)
    finally:
        del engine._step
    assert comparable(results["beam"]) == comparable(alone_beam)
    assert comparable(results["text"]) == comparable(alone_text)


@pytest.mark.parametrize("n", [1, 8])
def test_seeded_multinomial_calls_draw_what_they_draw_alone(gpt2_model, n):
    gen = generate.text(gpt2_model, samplers.multinomial(2, temperature=1.2))
    prompts = numbered_prompts(n)
    solo = [gen(p, max_tokens=8, rng=torch.Generator().manual_seed(i)) for i, p in enumerate(prompts)]
    together = concurrently([lambda i=i, p=p: gen(p, max_tokens=8, rng=torch.Generator().manual_seed(i))
                             for i, p in enumerate(prompts)])
    assert together == solo


def test_concurrent_choices_share_their_token_tree_forward(model):
    """Choice scoring's token trees of concurrent calls run in one forward (same tree width), choices and
    weights as alone."""
    choose = continuous(generate.choice(model, ["red", "green", "blue", "dark red"], samplers.greedy()))
    prompts = numbered_prompts(8)
    states = [continuous(generate.text(model, samplers.greedy()))(p, max_tokens=3) for p in prompts]
    solo = [comparable(choose(s + " Colour:")) for s in states]
    trees, kinds = [], set()
    real_run = model._run

    def spy(ids, mask, pos, past, logits, allowed=None, outputs=None):
        if allowed is not None:
            trees.append(ids.shape[0])
            kinds.add(logits)
        return real_run(ids, mask, pos, past, logits, allowed, outputs)

    model._run = spy
    try:
        together = concurrently([lambda s=s: comparable(choose(s + " Colour:")) for s in states])
    finally:
        del model._run
    assert together == solo
    assert sum(trees) >= len(states) and len(trees) < len(states)  # some trees shared a forward
    assert kinds == {"outputs"}  # (merged or alone, only the nodes read are projected: no (rows, N, vocab) tensor)
