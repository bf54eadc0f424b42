"""``models.remote`` (issue 58) against a real ``continuum serve`` on loopback, real httpx, no mocks: programs.

The same programs run on ``models.remote(url)`` and on the local model (the same checkpoint, transformers in this
process) and must give the same ids and weights (1e-4: the server's engine may merge a call with others), the same
texts and values, and the same count of positions computed (reuse is real: a continuation sends only the ids past
its handle, and the server computes only those). The server keeps no state in memory (``--state-memory 0``), so every
continuation loads its handle's state from the store, as after a restart.

Here: a text -> choice -> JSON chain, the state algebra (local: nothing sent), seeded samples and beams across turns,
run_batch of 32, streams (sync and async), guidance, speculation and reasoning, unfinished constrained steps resumed,
grammars, a prefill and a saved remote state, and the property tests' random state programs. Errors, restarts,
connections and repeated calls: ``test_remote_faults.py``; the server and the comparison: ``remote_support.py``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Literal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import remote_support
from conftest import FIXTURES
from remote_support import same

pytestmark = pytest.mark.skipif(not (FIXTURES / "models" / "stories260K").exists(), reason="fixtures absent")
server, remote, local = remote_support.server, remote_support.remote, remote_support.local  # the fixtures, by name


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    name: str


def chain(model):
    """text -> choice -> json, then a slice back to the end of the text step, resumed."""
    from continuum import continuous, generate, samplers

    story = continuous(generate.text(model, samplers.greedy()))
    mood = continuous(generate.choice(model, [" happy", " sad", " scared"]))
    card = continuous(generate.json(model, Pet, samplers.greedy(), whitespace_pattern=""))
    s1 = story("Once upon a time", max_tokens=12, stop_at=".")
    s2 = mood(s1 + " She was very")
    s3 = card(s2 + "\nHer pet as JSON: ", max_tokens=30)
    s4 = story(s3[:len(str(s1))] + " One day,", max_tokens=10)
    return [s1, s2, s3, s4]


def test_a_chain_equals_the_local_one_and_computes_as_much(remote, local):
    from continuum import SequenceState

    before_r, before_l = remote.tokens_computed, local.tokens_computed
    got, want = chain(remote), chain(local)
    for a, b in zip(got, want):
        same(a, b)
        assert isinstance(a, SequenceState) and a.model is remote
        assert repr(a) == repr(b)
    assert isinstance(got[2].value, Pet)  # parsed by the client's generator, as locally
    # reuse is real: the server computed exactly the positions the local model did (the continuations sent only
    # the ids past their handles; the whole chain costs far less than recomputing each input)
    assert remote.tokens_computed - before_r == local.tokens_computed - before_l
    assert remote.tokens_computed - before_r < sum(len(s.token_ids[0]) for s in want)


def test_the_algebra_is_local_and_continuing_any_of_it_equals_local(remote, local):
    from continuum import SequenceState, continuous, generate, samplers

    def run(model):
        text = continuous(generate.text(model, samplers.greedy()))
        a = text(["Tom went to the park", "Once upon a time"], max_tokens=6)
        b = text("The cat", max_tokens=5)
        views = [a[:, :14], a + [" and", " so"], "Title. " + b, b + b, a[1, ...], a[..., -8:]]
        stacked = SequenceState.stack([a[0, ...], b[:6]])  # rows of two stored states (and a cut)
        outs = [text(v, max_tokens=4) for v in views] + [text(stacked, max_tokens=4)]
        return views + [stacked] + outs

    calls_before = remote.forward_calls
    got = run(remote)
    assert remote.forward_calls - calls_before == 2 + 7  # slicing, adding and stacking sent nothing
    for a, b in zip(got, run(local)):
        same(a, b, values=False)
        assert repr(a) == repr(b)


def test_samples_with_a_seeded_rng_and_beams_across_turns(remote, local):
    from continuum import continuous, generate, samplers

    def run(model):
        rng = torch.Generator().manual_seed(7)
        draw = continuous(generate.text(model, samplers.multinomial(3)))
        beams = continuous(generate.text(model, samplers.beam_search(2)))
        s = draw("Lily and Tom", max_tokens=6, rng=rng)
        t = beams(s[1, :] + " Then", max_tokens=4)
        u = beams(t + " and", max_tokens=3)  # beams continuing beams: the handle's rows, reordered by the server
        return [s, t, u], torch.rand(3, generator=rng)  # the caller's rng moved on as a local call moves it

    got, rest = run(remote)
    want, rest_local = run(local)
    for a, b in zip(got, want):
        same(a, b)
    assert torch.equal(rest, rest_local)


def test_run_batch_of_32_equals_local(server, remote, local):
    from continuum import continuous, generate, run_batch, samplers

    def program_for(model):
        text = continuous(generate.text(model, samplers.greedy()))
        yes_no = continuous(generate.choice(model, [" yes", " no"]))

        def program(name: str):
            s = text(f"{name} went to the shop", max_tokens=5)
            return yes_no(s + ". Was it fun?")
        return program

    names = [f"{n}{suffix}" for suffix in ("", " Lee", " and Tim", " Smith") for n in
             ["Tom", "Lily", "Sue", "Max", "Ben", "Amy", "Sam", "Zoe"]]
    sent = remote.forward_calls
    got = run_batch(program_for(remote), names, concurrency=32)
    want = run_batch(program_for(local), names, concurrency=32)
    assert len(got) == len(want) == 32
    for a, b in zip(got, want):
        same(a, b)
    # the client joined each stage's 32 greedy calls into one list call (loop/coalesce; the server says its model
    # joins): one request per stage, each row still what it is alone (above)
    assert remote.joins and remote.forward_calls - sent == 2
    # 32 plain threads send 32 requests per stage: the server joins those that arrive together
    from concurrent.futures import ThreadPoolExecutor

    joined = _joined(server)
    with ThreadPoolExecutor(32) as pool:
        again = list(pool.map(program_for(remote), names))
    for a, b in zip(again, want):
        same(a, b)
    assert _joined(server) - joined >= 2


def _joined(server) -> int:
    """Requests' calls the server ran inside joint calls so far, from its ``/metrics``."""
    return int(server.metrics()["continuum:calls_joined_total"])


def test_streams_send_each_step_as_the_server_decodes_and_join_to_the_local_state(remote, local):
    from continuum import continuous, generate, samplers

    def streams(model):
        text = continuous(generate.text(model, samplers.greedy()))
        rng = torch.Generator().manual_seed(3)
        draws = continuous(generate.text(model, samplers.multinomial(2)))
        beams = continuous(generate.text(model, samplers.beam_search(2)))
        digits = continuous(generate.regex(model, r" [0-9]{2,4} years", samplers.greedy()))
        s = text.stream("Once upon a time", max_tokens=12, stop_at=".")
        chunks = [list(s)]
        more = [text.stream(s.state + " She", max_tokens=6), draws.stream(["Tom", "The dog"], max_tokens=5, rng=rng),
                beams.stream("Lily", max_tokens=4), digits.stream(s.state + " He was")]
        chunks += [list(m) for m in more]
        return chunks, [s.state] + [m.state for m in more]

    got, want = streams(remote), streams(local)
    assert got[0] == want[0] and len(got[0][0]) > 3  # one chunk per decoded token, as the local stream's
    for a, b in zip(got[1], want[1]):
        same(a, b)
    awaited = asyncio.run(continuous(generate.text(remote, samplers.greedy())).acall("Once upon a time", max_tokens=8))
    same(awaited, continuous(generate.text(local, samplers.greedy()))("Once upon a time", max_tokens=8))

    async def astream(model):
        s = continuous(generate.text(model, samplers.greedy())).astream("The cat", max_tokens=7)
        return [c async for c in s], s.state

    (ca, sa), (cb, sb) = asyncio.run(astream(remote)), asyncio.run(astream(local))
    assert ca == cb and len(ca) > 2
    same(sa, sb)
    # chunks come as the server decodes, not at the end: the first long before the last
    started = time.perf_counter()
    long = continuous(generate.text(remote, samplers.greedy())).stream("Once upon a time", max_tokens=120)
    assert next(long)
    first = time.perf_counter() - started
    assert len(list(long)) > 60
    assert first < 0.5 * (time.perf_counter() - started)
    # leaving a stream early closes its request (the server stops the call); the model goes on serving
    early = continuous(generate.text(remote, samplers.greedy())).stream("Once upon a time", max_tokens=200)
    assert next(early)
    early._iter.close()
    same(continuous(generate.text(remote, samplers.greedy()))("The cat", max_tokens=3),
         continuous(generate.text(local, samplers.greedy()))("The cat", max_tokens=3))


def _idle(server) -> None:
    """Wait until the server's engine runs no call: the positions a call reports count every call sharing its
    forwards, and a stream closed early (the test before) stops on the server a step or two later."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        engine = server.health()["engine"]
        if engine["running_calls"] == 0 and engine["waiting_calls"] == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"the server still runs calls after 10 s: {engine}")


def test_guidance_speculation_and_reasoning_run_on_the_server_as_locally(server, remote, local):
    """Classifier-free guidance (a scale, a negative prompt), prompt-lookup speculation and reasoning (a thought
    between markers, with a budget) travel with the generator: the server runs them as the local model does (greedy:
    the same ids, log-probs within 1e-4, the same positions computed, the same thought)."""
    from continuum import continuous, generate, samplers, speculate

    def run(model):
        s = continuous(generate.text(model, samplers.greedy()))("Once upon a time", max_tokens=6)
        guided = continuous(generate.text(model, samplers.greedy(), guidance_scale=1.5, negative_prompt="The dog"))
        drafted = continuous(generate.text(model, samplers.greedy(), speculate=speculate.lookup(ngram=2, max_draft=4)))
        number = continuous(generate.regex(model, r" [0-9]{2}", samplers.greedy(), guidance_scale=2.0))
        think = continuous(generate.regex(model, r" [0-9]{2}", samplers.greedy(), reasoning=("[T]", "[/T]"),
                                          thinking_budget=5))
        a = guided(s + " She", max_tokens=8)
        b = drafted(a + " Once upon a time", max_tokens=12)
        c = number(b + " Age:", max_tokens=4)
        return [a, b, c, think(c + " Then:", max_tokens=32)]

    _idle(server)
    before_r, before_l = remote.tokens_computed, local.tokens_computed
    got, want = run(remote), run(local)
    for x, y in zip(got, want):
        same(x, y)
    assert remote.tokens_computed - before_r == local.tokens_computed - before_l  # (drafts verified alike)
    assert got[-1].reasoning == want[-1].reasoning != ""  # (the thought's span travels with the last step)
    assert got[1]._last.speculation == want[1]._last.speculation is not None  # (drafted and accepted: the server's count)


def test_an_unfinished_constrained_step_is_resumed_as_locally(remote, local):
    """A regex or JSON step cut by max_tokens (IncompleteGenerationError), then the same generator again: the step
    resumes where it stopped on the server too (the guide's state rebuilt there from the step's tokens), so the value
    spans both calls, as locally. An edit in between, or a step cut by a stop string, starts the pattern afresh on
    both."""
    from continuum import continuous, generate, samplers
    from continuum.errors import IncompleteGenerationError

    def run(model):
        digits = continuous(generate.regex(model, r" [0-9]{6}\.", samplers.greedy()))
        small = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer",
                 "minimum": 0, "maximum": 99}}, "required": ["kind", "n"]}
        card = continuous(generate.json(model, small, samplers.greedy(), whitespace_pattern=""))
        s = continuous(generate.text(model, samplers.greedy()))("Once upon a time", max_tokens=4)
        a = digits(s, max_tokens=3)
        with pytest.raises(IncompleteGenerationError):
            a.value
        b = digits(a, max_tokens=12)  # (resumed: the value is the whole pattern)
        c = card(b + " Pet:", max_tokens=4)
        d = card(c, max_tokens=30)  # (resumed)
        e = digits(a + " x", max_tokens=12)  # (edited: afresh)
        f = digits(s, max_tokens=12, stop_at="0")  # (cut by a stop string: not resumable, locally either)
        return [a, b, c, d, e, f, digits(f, max_tokens=12)]

    got, want = run(remote), run(local)
    for i, (x, y) in enumerate(zip(got, want)):
        same(x, y, values=i in (1, 3, 4, 6))  # (0, 2 and 5: unfinished, their value raises on both)
    assert got[1].value.startswith(" ") and len(got[1].value) == 8 and set(got[3].value) == {"kind", "n"}


def test_regex_grammar_prefill_and_a_saved_remote_state(remote, local, tmp_path):
    from continuum import SequenceState, continuous, generate, samplers

    grammar = 'start: NAME " is " AGE\nNAME: /[A-Z][a-z]{1,6}/\nAGE: /[1-9][0-9]?/\n'

    def run(model, path):
        prefill = continuous(generate.text(model, samplers.greedy()))("Once upon a time", max_tokens=0)
        age = continuous(generate.regex(model, r" [0-9]{1,2} years", samplers.greedy()))(prefill + ", Tom was")
        age.save(path)  # a remote state's file keeps its handle (and its tokens, as any state file)
        back = SequenceState.load(path, model)
        said = continuous(generate.cfg(model, grammar, samplers.greedy()))(back + ". ", max_tokens=12)
        return [prefill, age, back, said]

    before_r, before_l = remote.tokens_computed, local.tokens_computed
    got, want = run(remote, tmp_path / "r.safetensors"), run(local, tmp_path / "l.safetensors")
    for a, b in zip(got, want):
        same(a, b)
    assert remote.tokens_computed - before_r == local.tokens_computed - before_l  # the loaded handle was reused


# the state-algebra property tests' programs (tests/test_properties_programs.py: the text strategy, the character slices)
# drawn once and run on both models in lockstep: every step's remote state equals the local one, and every
# continuation computes as many positions on the server as locally. CONTINUUM_REMOTE_EXAMPLES sets the profile.
@settings(max_examples=int(os.environ.get("CONTINUUM_REMOTE_EXAMPLES", "12")), deadline=None, derandomize=True,
          database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_state_programs_on_remote_equal_local(remote, local, data):
    from continuum import SequenceState, continuous, generate, samplers

    from conftest import chars_key
    from properties_support import texts

    prompts = data.draw(st.lists(texts, min_size=1, max_size=2), "prompts")
    pair = [SequenceState.from_prompts(m, prompts) for m in (remote, local)]
    for _ in range(data.draw(st.integers(2, 6), "steps")):
        r, loc = pair
        ops = ["gen", "gen", "slice", "add_text", "add_state", "radd", "select"] + (["fork"] if r.samples == 1 else [])
        ops += ["stack"] if r.batch <= 2 else []
        op = data.draw(st.sampled_from(ops), "op")
        if op in ("gen", "fork"):
            n = r.samples if op == "gen" else data.draw(st.integers(2, 3), "n")
            kinds = (["greedy"] if n == 1 else []) + ["multinomial", "beam"]
            kind = data.draw(st.sampled_from(kinds), "sampler")
            k = data.draw(st.integers(1 if kind == "beam" and n > r.samples else 0, 3), "k")
            seed = data.draw(st.integers(0, 2**16), "seed")
            sampler = (samplers.greedy() if kind == "greedy" else samplers.multinomial(n) if kind == "multinomial"
                       else samplers.beam_search(n))
            if any(len(ids) == 0 for ids, _ in loc._real_rows()):
                continue
            counts = [m.tokens_computed for m in (remote, local)]
            new = [continuous(generate.text(m, sampler))(s, max_tokens=k, rng=torch.Generator().manual_seed(seed))
                   for m, s in zip((remote, local), pair)]
            assert remote.tokens_computed - counts[0] == local.tokens_computed - counts[1]
        elif op == "slice":
            longest = max(len(t) for t in r)
            sl = slice(data.draw(st.one_of(st.none(), st.integers(-longest - 1, longest + 1)), "start"),
                       data.draw(st.one_of(st.none(), st.integers(-longest - 1, longest + 1)), "stop"))
            tokens = data.draw(st.booleans(), "as tokens")
            new = [s[chars_key(s, sl, tokens)] for s in pair]
            if any(len(ids) == 0 for ids, _ in new[1]._real_rows()):
                continue
        elif op == "add_text":
            extra = data.draw(texts, "text")
            new = [s + extra for s in pair]
        elif op == "add_state":
            cut = data.draw(st.integers(0, max(len(t) for t in r)), "cut")
            new = [s + s[chars_key(s, slice(None, cut), False)] for s in pair]
        elif op == "radd":
            prefix = data.draw(texts, "prefix")
            new = [prefix + s for s in pair]
        elif op == "stack":
            new = [SequenceState.stack([s, s[::-1, ...]]) for s in pair]
        else:
            b = data.draw(st.lists(st.integers(0, r.batch - 1), min_size=1, max_size=3), "rows")
            new = [s[b, ...] for s in pair]
        if max(len(ids) for ids, _ in new[1]._real_rows()) > 400:  # (the context is 512)
            continue
        same(new[0], new[1], values=False)
        pair = new
