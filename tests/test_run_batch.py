"""``continuum.run_batch``: many program instances at once, each giving what it gives alone.

The reference is always the program run alone for each input, one after another. Programs branch on
their own outputs (text -> choice -> regex or JSON), sample with their own ``rng``, and carry
continuous states. Errors, bad arguments, the progress bar and Ctrl-C are tested on the same tiny model.
"""

from __future__ import annotations

import _thread
import threading
import time

import pytest
import torch

import continuum
from continuum import ProgramError, SequenceState, continuous, generate, samplers
from continuum.errors import ContinuumTypeError, GeneratorArgumentError

PROMPTS = ["Once upon a time", "The quick brown fox", "Le café est", "Numbers: 0 1 2", "She said", "Review: great",
           "The dog sleeps", "Emoji time"]


def same(a, b) -> bool:
    """Equal results; states: same texts and token ids, weights within 1e-4."""
    if isinstance(a, SequenceState):
        return (isinstance(b, SequenceState) and list(a) == list(b) and a.token_ids.tolist() == b.token_ids.tolist()
                and torch.allclose(a.weights, b.weights, atol=1e-4, rtol=0))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def branching_program(model):
    """text -> choice -> (regex | JSON), on continuous states: the control flow depends on the outputs."""
    text_c = continuous(generate.text(model, samplers.greedy()))
    pick = continuous(generate.choice(model, [" yes", " no"], samplers.greedy()))
    number = continuous(generate.regex(model, r"[0-9]{1,3}", samplers.greedy()))
    flag = continuous(generate.json(model, {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                            "required": ["ok"]}, samplers.greedy()))

    def program(prompt: str):
        s = text_c(prompt, max_tokens=4)
        c = pick(s + " Sure?")
        if c.value == " yes":
            out = number(c + " n=", max_tokens=4)
        else:
            out = flag(c + " JSON:", max_tokens=12)
        return c.value, out.value, out

    return program


def test_branching_program_matches_solo_runs_in_input_order(gpt2_model):
    program = branching_program(gpt2_model)
    solo = [program(p) for p in PROMPTS]
    assert {r[0] for r in solo} == {" yes", " no"} or len(solo) == len(PROMPTS)  # both branches usually taken
    batched = continuum.run_batch(program, PROMPTS, concurrency=4)
    assert len(batched) == len(PROMPTS)
    for a, b in zip(solo, batched):
        assert same(a, b)


def test_multinomial_with_per_input_rng_draws_what_it_draws_alone(model):
    gen = generate.text(model, samplers.multinomial(2, temperature=1.5))

    def program(i: int):
        return gen(PROMPTS[i % len(PROMPTS)], max_tokens=5, rng=torch.Generator().manual_seed(100 + i))

    solo = [program(i) for i in range(6)]
    assert continuum.run_batch(program, range(6), concurrency=6) == solo


def test_every_generator_kind_and_sampler_matches_its_solo_run(gpt2_model):
    """One instance per kind, all at once: beam search, CFG, stop strings, token healing, a grammar, choice by
    sampling, JSON with fast-forward, continuous states continued and forked."""
    m = gpt2_model
    text_c = continuous(generate.text(m, samplers.greedy()))
    base = text_c(PROMPTS[0], max_tokens=4)

    def rng(i: int) -> torch.Generator:
        return torch.Generator().manual_seed(i)

    jobs = [
        lambda: generate.text(m, samplers.beam_search(2))(PROMPTS[1], max_tokens=4),
        lambda: generate.text(m, samplers.greedy(), guidance_scale=2.0, negative_prompt="Bad")(PROMPTS[2], max_tokens=4),
        lambda: generate.text(m, samplers.greedy())(PROMPTS[3], max_tokens=8, stop_at=" "),
        lambda: generate.text(m, samplers.greedy(), token_healing=True)("Numbers: 0 1 ", max_tokens=3),
        lambda: generate.cfg(m, 'start: "a" ("b" | "c")+', samplers.multinomial())(PROMPTS[4], max_tokens=4, rng=rng(1)),
        lambda: generate.choice(m, [" x", " y", " z"], samplers.multinomial(2))(PROMPTS[5], rng=rng(2)),
        lambda: generate.json(m, {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]},
                              samplers.greedy(), whitespace_pattern="")(PROMPTS[6], max_tokens=12),
        lambda: text_c(base + " and", max_tokens=3),
        lambda: continuous(generate.text(m, samplers.multinomial(3)))(base, max_tokens=3, rng=rng(3)),
    ]
    solo = [job() for job in jobs]
    assert all(same(a, b) for a, b in zip(solo, continuum.run_batch(lambda job: job(), jobs, concurrency=len(jobs))))


def test_results_keep_input_order_when_later_inputs_finish_first(gpt2_model):
    gen = generate.text(gpt2_model, samplers.greedy())
    lengths = [12, 1, 8, 0, 3]  # the long first instance finishes last
    finished: list[int] = []

    def program(i: int):
        out = gen(PROMPTS[i], max_tokens=lengths[i])
        finished.append(i)
        return out

    solo = [gen(PROMPTS[i], max_tokens=lengths[i]) for i in range(5)]
    assert continuum.run_batch(program, range(5), concurrency=5) == solo


def test_a_generator_of_inputs_is_pulled_lazily():
    pulled, running, peak = [0], [0], [0]
    lock = threading.Lock()

    def inputs():
        for i in range(40):
            pulled[0] += 1
            yield i

    def program(x: int):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            assert pulled[0] <= x + 1 + 3  # never more than the running instances ahead
        time.sleep(0.002)
        with lock:
            running[0] -= 1
        return x * x

    assert continuum.run_batch(program, inputs(), concurrency=3) == [i * i for i in range(40)]
    assert peak[0] <= 3 and pulled[0] == 40


@pytest.mark.parametrize("threads", [False, True])
def test_workers_start_as_inputs_arrive(threads):
    before = set(threading.enumerate())
    names = continuum.run_batch(lambda x: threading.current_thread().name, iter(range(3)), concurrency=1000,
                                threads=threads)
    if threads:  # a thread per instance, started as inputs are pulled
        assert len(set(names)) <= 3 and all(n.startswith("continuum-run_batch-") for n in names)
    else:  # every instance on the one lockstep thread
        assert set(names) == {"continuum-run_batch"}
    time.sleep(0.05)
    assert len(set(threading.enumerate()) - before) == 0  # at most 4 were started, and all of them left


def test_failed_instances_do_not_disturb_the_others(gpt2_model):
    gen = generate.text(gpt2_model, samplers.greedy())

    def program(i: int):
        if i % 3 == 1:
            raise ValueError(f"bad input {i}")
        return gen(PROMPTS[i], max_tokens=3)

    with pytest.raises(ProgramError) as info:
        continuum.run_batch(program, range(6), concurrency=3)
    err = info.value
    assert sorted(err.errors) == [1, 4] and all(isinstance(e, ValueError) for e in err.errors.values())
    assert err.results == [None if i % 3 == 1 else gen(PROMPTS[i], max_tokens=3) for i in range(6)]
    assert "inputs 1, 4" in str(err) and "bad input 1" in str(err) and err.__cause__ is err.errors[1]
    assert isinstance(err, continuum.ContinuumError)

    mixed = continuum.run_batch(program, range(6), concurrency=3, return_exceptions=True)
    assert [isinstance(m, ValueError) for m in mixed] == [i % 3 == 1 for i in range(6)]
    assert mixed[0] == err.results[0] and str(mixed[4]) == "bad input 4"


def test_prompts_tokenized_together_give_what_each_gives_alone(gpt2_model):
    """A program's prompt is tokenized with every other instance's by their first joint call (``state/deferred``):
    each instance still gets what it gets alone; an empty prompt (gpt2 adds no BOS: a row of no token) and a prompt
    UTF-8 cannot encode are refused in their own instances only."""
    from continuum.errors import UnencodableTextError
    from continuum.loop import coalesce

    gen = generate.text(gpt2_model, samplers.greedy())
    text_c = continuous(generate.text(gpt2_model, samplers.greedy()))

    def program(p: str):
        return gen(p, max_tokens=3), text_c(p, max_tokens=2) + "!"

    def alone(p: str):
        try:
            return program(p)
        except (UnencodableTextError, GeneratorArgumentError) as e:
            return e

    good = PROMPTS + [" ".join(PROMPTS)]
    coalesce.reset_stats()
    assert all(same(alone(p), b) for p, b in zip(good, continuum.run_batch(program, good, concurrency=len(good))))
    assert coalesce.stats()["calls_joined"] == 2 * len(good) and not coalesce.stats()["joint_failures"]
    bad = PROMPTS[:3] + ["", "a \ud800 lone surrogate"] + PROMPTS[3:]
    solo = [alone(p) for p in bad]
    batched = continuum.run_batch(program, bad, concurrency=len(bad), return_exceptions=True)
    assert [type(x) for x in batched] == [type(x) for x in solo]
    assert isinstance(solo[3], GeneratorArgumentError) and isinstance(solo[4], UnencodableTextError)
    assert [str(b) for a, b in zip(solo, batched) if isinstance(a, Exception)] == [str(a) for a in solo
                                                                                   if isinstance(a, Exception)]
    assert all(same(a, b) for a, b in zip(solo, batched) if not isinstance(a, Exception))


def test_a_failing_input_iterator_is_raised_after_the_running_instances():
    def inputs():
        yield 1
        yield 2
        raise KeyError("feed broke")

    with pytest.raises(KeyError, match="feed broke"):
        continuum.run_batch(lambda x: x, inputs(), concurrency=2)


@pytest.mark.parametrize("args, kwargs, error, words", [
    ((lambda x: x, [1]), {"concurrency": 0}, GeneratorArgumentError, "concurrency must be >= 1"),
    ((lambda x: x, [1]), {"concurrency": 2.0}, ContinuumTypeError, "concurrency must be an int"),
    ((lambda x: x, [1]), {"concurrency": True}, ContinuumTypeError, "concurrency must be an int"),
    ((42, [1]), {}, ContinuumTypeError, "program must be a callable"),
    ((lambda x: x, 7), {}, ContinuumTypeError, "inputs must be an iterable"),
    ((lambda x: x, "some text"), {}, ContinuumTypeError, "run_batch(program, [text])"),
    ((lambda x: x, [1]), {"progress": "yes"}, GeneratorArgumentError, "progress must be True or False"),
    ((lambda x: x, [1]), {"return_exceptions": None}, GeneratorArgumentError, "return_exceptions must be True or False"),
])
def test_bad_arguments_get_continuum_errors(args, kwargs, error, words):
    with pytest.raises(error) as info:
        continuum.run_batch(*args, **kwargs)
    assert words in str(info.value)


def test_empty_inputs_give_an_empty_list():
    assert continuum.run_batch(lambda x: x, []) == []
    assert continuum.run_batch(lambda x: x, iter(())) == []


def test_progress_bar_counts_instances_and_tokens(gpt2_model, capsys):
    gen = generate.text(gpt2_model, samplers.greedy())
    out = continuum.run_batch(lambda p: gen(p, max_tokens=4), PROMPTS[:3], concurrency=2, progress=True)
    assert out == [gen(p, max_tokens=4) for p in PROMPTS[:3]]
    err = capsys.readouterr().err
    assert "run_batch" in err and "3/3" in err and "tok/s" in err
    rate = float(err.rsplit("tok/s", 1)[0].split()[-1].strip(", "))
    assert rate > 0  # the decoding loop counted the generated tokens


@pytest.mark.parametrize("threads", [False, True])
def test_nested_run_batch(gpt2_model, threads):
    gen = generate.text(gpt2_model, samplers.greedy())

    def program(p: str):
        return continuum.run_batch(lambda q: gen(q, max_tokens=2), [p, p + "!"], concurrency=2, threads=threads)

    expected = [[gen(p, max_tokens=2), gen(p + "!", max_tokens=2)] for p in PROMPTS[:3]]
    assert continuum.run_batch(program, PROMPTS[:3], concurrency=3, threads=threads) == expected


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("continuum-run_batch")]


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("swallow", [False, True])
def test_ctrl_c_stops_every_instance_and_leaves_the_model_usable(gpt2_model, swallow, threads, python_ctrl_c):
    gen = generate.text(gpt2_model, samplers.greedy())
    before = gen(PROMPTS, max_tokens=6)
    started, gave_up = threading.Event(), threading.Event()
    steps = [0]

    def program(p: str):  # never ends by itself: only the cancellation stops it (or, failing, the watchdog below)
        while not gave_up.is_set():
            started.set()
            try:
                gen(p, max_tokens=40)
                steps[0] += 1
            except Exception:  # a program's own except Exception must not swallow the cancellation
                if not swallow:
                    raise

    def interrupt():
        started.wait(30)
        time.sleep(0.2)
        _thread.interrupt_main()  # what Ctrl-C does: KeyboardInterrupt in the main thread
        time.sleep(60)
        gave_up.set()  # (the interrupt was lost: the programs end, and pytest.raises fails instead of a hang)

    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        continuum.run_batch(program, PROMPTS * 4, concurrency=8, threads=threads)
    assert time.perf_counter() - t0 < 20
    assert not _workers()  # every instance left before run_batch re-raised
    calls = gpt2_model.forward_calls
    time.sleep(0.1)
    assert gpt2_model.forward_calls == calls  # nothing keeps running in the background
    assert gen(PROMPTS, max_tokens=6) == before


def test_cancelling_a_run_stops_its_loops_at_the_next_step(gpt2_model):
    """The cancel path itself (what the KeyboardInterrupt handler runs), without a signal."""
    from continuum.loop.cancel import Cancelled, CancelToken, bound

    gen = continuous(generate.text(gpt2_model, samplers.greedy()))
    token = CancelToken()
    seen: list = []

    def run():
        with bound(token):
            try:
                gen(PROMPTS[0], max_tokens=200)
            except Cancelled:
                seen.append("cancelled")

    token.cancel()
    worker = threading.Thread(target=run)
    c0 = gpt2_model.forward_calls
    worker.start()
    worker.join(10)
    assert seen == ["cancelled"] and gpt2_model.forward_calls - c0 == 1  # the prefill ran, no decoding step


def test_lockstep_programs_that_stream_chat_sample_and_block_match_their_solo_runs(gpt2_model):
    """What a program may do besides plain calls, in lockstep (the default): iterate a stream (its steps wait on the
    lockstep thread), hold a chat, draw with its own rng (each call alone, on a call thread), sleep (holding every
    instance: slower, never wrong). Each instance returns what it returns alone."""
    from continuum.chat import Chat

    text = generate.text(gpt2_model, samplers.greedy())
    draw = continuous(generate.text(gpt2_model, samplers.multinomial()))

    def program(i: int):
        p = PROMPTS[i % len(PROMPTS)]
        streamed = "".join(text.stream(p, max_tokens=4))
        chat = Chat(gpt2_model, template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}").user(p)
        reply = chat.reply(generate.text(gpt2_model, samplers.greedy()), max_tokens=3).value
        sample = draw(p, max_tokens=4, rng=torch.Generator().manual_seed(i))
        time.sleep(0.001)
        return streamed, reply, sample

    solo = [program(i) for i in range(6)]
    got = continuum.run_batch(program, range(6), concurrency=6)
    assert [g[:2] for g in got] == [s[:2] for s in solo]
    assert all(same(g[2], s[2]) for g, s in zip(got, solo))  # (weights within 1e-4: other rows beside it in a step)


def test_a_joint_call_counts_its_tokens_live_and_stops_once_every_member_is_cancelled():
    """The token a lockstep joint call runs under (programs/lockstep._AllOf): each step's tokens go to its first
    member's count at once (run_batch's progress bar reads it while the call runs), and it is cancelled only when
    every member is (one acall cancelled alone must not stop the others' rows)."""
    from continuum.loop.cancel import Cancelled, CancelToken, bound, check_cancelled
    from continuum.programs.lockstep import _AllOf

    run = CancelToken()
    members = [CancelToken(parent=run), CancelToken(parent=run)]
    members[0].tokens = 5
    joint = _AllOf(members)
    with bound(joint):
        check_cancelled(3)
        assert members[0].tokens == 8 and members[1].tokens == 0
        members[0].cancel()
        check_cancelled(1)  # (one member cancelled: the call goes on)
        members[1].cancel()
        with pytest.raises(Cancelled):
            check_cancelled(1)
    other = _AllOf([CancelToken(parent=run), CancelToken(parent=run)])
    run.cancel()  # (Ctrl-C: the run's token, every member's parent)
    assert other.cancelled


def test_the_one_call_out_runs_in_the_callers_thread_and_others_on_call_threads(gpt2_model, monkeypatch):
    """In lockstep, when every instance waits on one joint call and nothing else runs, that call runs in run_batch's
    caller, the thread that drives the engine's steps (loop/host.py: a call thread's torch operations would start a
    second OpenMP team); two cohorts at once still run on call threads. Each program gets what it gets alone."""
    from continuum.loop import coalesce

    seen: list[threading.Thread] = []
    joint = coalesce.joint

    def recorded(states, alone):
        seen.append(threading.current_thread())
        return joint(states, alone)

    monkeypatch.setattr(coalesce, "joint", recorded)
    text = continuous(generate.text(gpt2_model, samplers.greedy()))
    short = continuous(generate.text(gpt2_model, samplers.greedy()))
    one = continuum.run_batch(lambda p: text(p, max_tokens=4), PROMPTS, concurrency=len(PROMPTS))
    assert seen and all(t is threading.current_thread() for t in seen), seen
    seen.clear()
    two = continuum.run_batch(lambda i: (text if i % 2 else short)(PROMPTS[i], max_tokens=3 + i % 2),
                              range(len(PROMPTS)), concurrency=len(PROMPTS))
    assert len(seen) == 2 and all(t is not threading.current_thread() for t in seen), seen
    assert [list(s) for s in one] == [list(text(p, max_tokens=4)) for p in PROMPTS]
    assert [list(s) for s in two] == [list((text if i % 2 else short)(PROMPTS[i], max_tokens=3 + i % 2))
                                      for i in range(len(PROMPTS))]


def test_ctrl_c_landing_in_a_call_s_step_stops_the_run(gpt2_model):
    """Ctrl-C reaches the main thread wherever it runs: with a thread per program, run_batch's caller drives the
    engine's steps, so the KeyboardInterrupt can surface inside a call's own code (here its sampler). It used to end
    that one call with it as the call's error (the program failed, the others ran on, a program that never ends held
    run_batch forever: a CI hang); now the call ends cancelled and run_batch raises KeyboardInterrupt."""
    from continuum.samplers import GreedySampler

    class Interrupted(GreedySampler):  # (Ctrl-C arriving while the main thread computes a step)
        fired = False

        def __call__(self, *args, **kwargs):
            if threading.current_thread() is threading.main_thread() and not Interrupted.fired:
                Interrupted.fired = True
                raise KeyboardInterrupt
            return super().__call__(*args, **kwargs)

    gen = generate.text(gpt2_model, Interrupted())

    def program(p: str):
        while True:  # (never ends by itself: only the interrupt stops it)
            gen(p, max_tokens=4)

    def watchdog():  # (should the main thread never compute a step: a failure, not a hang)
        if not done.wait(60) and not Interrupted.fired:
            _thread.interrupt_main()

    done = threading.Event()
    threading.Thread(target=watchdog, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            continuum.run_batch(program, PROMPTS, concurrency=4, threads=True)
    finally:
        done.set()
    assert Interrupted.fired and not _workers()
    assert gen(PROMPTS[0], max_tokens=3) == generate.text(gpt2_model, samplers.greedy())(PROMPTS[0], max_tokens=3)
