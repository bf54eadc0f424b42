"""One model, several threads: shared and separate generators give the results of sequential runs.

Every job runs twice: sequentially, then all at once from a thread pool started behind a barrier
(so the calls overlap). Results must be equal, and ``model.tokens_computed`` must grow by exactly
what the sequential runs added. ``forward_calls`` may grow less: concurrent calls share forwards
(continuum/loop/engine.py), never more.
"""

from __future__ import annotations

import threading

import pytest
import torch

from continuum import SequenceState, continuous, generate, samplers

PROMPTS = ["Once upon a time", "The quick brown fox", "Le café est", "Numbers: 0 1 2", "She said", "Review: great"]


def same_work(thr_counts, seq_counts) -> bool:
    """The same positions computed; merged forwards: at most as many model calls."""
    return thr_counts[0] == seq_counts[0] and 0 < thr_counts[1] <= seq_counts[1]


def run_both(model, jobs, workers: int = 6):
    """Results of ``jobs`` run sequentially and concurrently, plus the counters each way added."""

    def counters():
        return model.tokens_computed, model.forward_calls

    c0 = counters()
    sequential = [job() for job in jobs]
    c1 = counters()
    workers = min(workers, len(jobs))
    barrier = threading.Barrier(workers)
    concurrent: list = [None] * len(jobs)
    errors: list = []

    def worker(w: int) -> None:  # jobs w, w + workers, ...: all threads start together
        barrier.wait(timeout=60)
        try:
            for j in range(w, len(jobs), workers):
                concurrent[j] = jobs[j]()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    c2 = counters()
    return sequential, concurrent, (c1[0] - c0[0], c1[1] - c0[1]), (c2[0] - c1[0], c2[1] - c1[1])


class Close:
    """Weights compare within 1e-4: a merged forward sums in another order than a lone one (same tokens)."""

    def __init__(self, values: torch.Tensor):
        self.values = values.detach().float()

    def __eq__(self, other) -> bool:
        return isinstance(other, Close) and torch.allclose(self.values, other.values, atol=1e-4, rtol=0, equal_nan=True)

    def __repr__(self) -> str:
        return repr(self.values.tolist())


def comparable(result):
    if isinstance(result, SequenceState):
        return list(result), Close(result.weights), result.token_ids.tolist()
    return result


@pytest.mark.parametrize("kind", ["greedy", "multinomial"])
def test_shared_and_separate_generators_match_sequential_runs(model, kind):
    def sampler():
        return samplers.greedy() if kind == "greedy" else samplers.multinomial(2, temperature=1.5)

    shared = generate.text(model, sampler())
    shared_c = continuous(generate.text(model, sampler()))
    base = continuous(generate.text(model, samplers.greedy()))(PROMPTS[:2], max_tokens=4)

    def rng(i):
        return torch.Generator().manual_seed(1000 + i) if kind == "multinomial" else None

    jobs = []
    for i, p in enumerate(PROMPTS[:4]):
        jobs.append(lambda i=i, p=p: shared(p, max_tokens=8, rng=rng(i)))                          # shared generator
        jobs.append(lambda i=i, p=p: generate.text(model, sampler())([p, p[:5]], max_tokens=6, rng=rng(i)))  # separate
        # the same state continued by many threads at once: each call appends to its own cache
        jobs.append(lambda i=i: shared_c(base, max_tokens=3 + i % 3, rng=rng(i)))
        jobs.append(lambda i=i: shared_c(base[:, :12] + " and", max_tokens=4, rng=rng(i)))
    sequential, concurrent, seq_counts, thr_counts = run_both(model, jobs)
    assert [comparable(r) for r in concurrent] == [comparable(r) for r in sequential]
    assert same_work(thr_counts, seq_counts) and seq_counts[0] > 0
    # the shared input state is untouched and still continues as before
    assert comparable(shared_c(base, max_tokens=3, rng=rng(0))) == comparable(sequential[2])


def test_constrained_generators_in_threads(model):
    """Regex and choice guides compiled and used from several threads (index caches are locked)."""
    regexes = [r"[0-9]{2}-[a-z]{3}", r"(yes|no|maybe)", r"\(x[0-9]\)"]

    jobs = []
    for p in PROMPTS[:3]:
        for r in regexes:  # a new generator per job: the first jobs compile the same regexes concurrently
            jobs.append(lambda p=p, r=r: comparable(continuous(generate.regex(model, r, samplers.greedy()))(p, max_tokens=8)))
        jobs.append(lambda p=p: generate.choice(model, ["red", "green", "blue"], samplers.greedy())(p))
    sequential, concurrent, seq_counts, thr_counts = run_both(model, jobs, workers=8)
    assert concurrent == sequential and same_work(thr_counts, seq_counts)


def test_tokens_computed_is_exact_under_contention(gpt2_model):
    """Many tiny forwards from many threads: no update of the counters is lost."""
    gen = generate.text(gpt2_model, samplers.greedy())
    jobs = [lambda: gen("a", max_tokens=1) for _ in range(64)]
    sequential, concurrent, seq_counts, thr_counts = run_both(gpt2_model, jobs, workers=16)
    one = len(gpt2_model.tokenizer.encode_prompts(["a"])[0])  # max_tokens=1: one forward over the prompt
    assert concurrent == sequential and same_work(thr_counts, seq_counts) and seq_counts == (64 * one, 64)


def test_stream_used_from_two_threads_is_a_clear_error(gpt2_model):
    """A stream belongs to one thread: a second thread's next() raises, and the stream stays usable."""
    gen = generate.text(gpt2_model, samplers.greedy())
    expected = list(gen.stream("Once upon a time", max_tokens=6))
    stream = gen.stream("Once upon a time", max_tokens=6)
    inside, release = threading.Event(), threading.Event()
    owner: list = []

    def hook(module, args, kwargs):  # hold the stream's first forward (run by the engine): its owner waits inside next()
        if owner and not inside.is_set():
            inside.set()
            release.wait(timeout=30)

    handle = gpt2_model.model.register_forward_pre_hook(hook, with_kwargs=True)
    first: list = []
    try:
        t = threading.Thread(target=lambda: first.append(next(stream)))
        owner.append(t)
        t.start()
        assert inside.wait(timeout=30)
        with pytest.raises(RuntimeError, match="another thread"):
            next(stream)
        release.set()
        t.join()
    finally:
        handle.remove()
    assert first + list(stream) == expected
