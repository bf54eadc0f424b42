"""An oracle, not a mirror (issue 56; DESIGN.md wave 9: "a reference decides what is right, not continuum").

A hypothesis ``RuleBasedStateMachine`` draws histories, because a wrong result can depend on what ran before (a memo
keyed by less than the whole context, a reused buffer). From fresh prompts it draws: greedy text; seeded multinomial
samples; forks (``multinomial(n)``) and ``beam_search(n)``; greedy choices over 1..3-token options with shared
prefixes, and over 70 (more paths than a small llama.cpp pool's sequence ids, trees of 64+ nodes); regex and JSON
calls; ``state[..., :k]`` cuts; ``state + "text"`` and ``state + state``; save/load;
``continuum.run_batch`` of a few one- or two-call programs, calls on threads, and ``acall`` merged by
``asyncio.gather`` (the same state may be drawn twice). Calls run on the prefix cache on or off and, on
transformers, under a ``kv_budget`` that makes calls wait; on llama.cpp the pool is roomy or 256 cells (calls park,
held states spill).

Backends: on transformers, the pretrained stories260K, a random tiny Llama over the real qwen2 BPE tokenizer, a random
tiny Qwen2 whose second layer attends over a sliding window of 8 tokens (``window``: states outgrow it many times), and
the random LFM2 hybrid fixture (``lfm2``: convolution layers' recurrent snapshots; no prefix cache there); the f32
stories260K GGUF on llama.cpp, default and batch-invariant modes (skipped without the fixtures or llama_cpp).

EVERY result is checked against the backend's own reference over the same token ids (``tests/oracle_support.py``):
each stored log-prob and each weight against a fresh forward (transformers, 1e-4 in fp32) or llama-cpp-python's own
``Llama.eval`` (the tolerance docs/llamacpp.md documents); greedy tokens and choices against the reference's argmax
where its top-2 margin exceeds the noise (1e-3 in fp32); beams against transformers' ``generate(num_beams=n)``;
regex and JSON texts against ``re`` and ``jsonschema``.

Profiles: CI (default) runs a few short derandomized histories per backend (~60 s on 2 cores). The long profile,
``CONTINUUM_ORACLE=long python -m pytest tests/test_oracle.py`` (many more and longer random histories, a new seed
each run; ``CONTINUUM_ORACLE_EXAMPLES=N`` sets how many), is to run before every stop; ``CONTINUUM_ORACLE_KNOWN=1``
also draws the histories that hit the known bugs at once. Every bug it finds becomes a named regression test
in ``tests/test_oracle_regressions.py``.
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, rule, run_state_machine_as_test
from oracle_backends import JSON_SCHEMAS, MAX_TOKENS, Backend, gguf_path, hf_backend, llama_backend, remote_backend
from oracle_checks import check_state, real_rows
from oracle_support import (
    OPTIONS,
    Call,
    Held,
    _one_thread,  # noqa: F401  (autouse: one intra-op thread for this module)
    cut_carried,
    execute,
    gather,
    keep,
    longest,
    prepare,
    run_program,
    verify,
)

import continuum
from continuum import SequenceState

from conftest import chars_key

LONG = os.environ.get("CONTINUUM_ORACLE") == "long"
# Histories that hit a known bug (an xfail regression in test_oracle_regressions.py) at once are drawn only with
# CONTINUUM_ORACLE_KNOWN=1, so that the long profile finds new ones. None now: greedy calls without max_tokens on
# llama.cpp (several rows to the context outgrowing a pool together:
# test_a_call_of_two_rows_to_the_context_of_a_small_pool_regression) are drawn too.
# The spilled fork family that the long profile found in both modes (each member's bytes holding its own copy of the
# shared prefix, refused with "no room to restore a spilled state" though it fitted resident) shares the prefix again
# on restore (models/llamacpp/reshare.py; test_llamacpp_spill.py::test_a_spilled_fork_family_*, and a member spilled
# beside a resident relative: test_a_member_spilled_beside_a_resident_relative_*).
# Both one-offs of the sixth session are explained: "no room to restore a spilled state of 255 tokens" was a short cut
# of a dropped long state restoring its whole bytes (cut back now: test_llamacpp_spill.py::test_a_spilled_state_whose_
# longest_view_was_dropped_*), and "no room ... of 125 tokens" a fork-family member spilled twice that no longer
# matched its relatives (test_a_member_spilled_twice_*); the greedy token past position 450 that differed from the
# reference's argmax was a near-tie the oracle compared with too small a margin (test_greedy_margin_regression).
KNOWN = os.environ.get("CONTINUUM_ORACLE_KNOWN") == "1"
CI_BUDGET = {"stories": (6, 10), "tiny": (2, 8), "window": (3, 8), "lfm2": (3, 8), "gguf": (10, 12),
             "gguf-invariant": (10, 12), "gguf-lfm2": (4, 10), "gguf-window": (4, 10),
             "remote-gguf-window": (3, 8)}  # (histories, steps)
LONG_BUDGET = {"stories": (100, 40), "tiny": (30, 30), "window": (40, 30), "lfm2": (40, 30), "gguf": (200, 40),
               "gguf-invariant": (200, 40), "gguf-lfm2": (60, 30), "gguf-window": (60, 30),
               "remote-gguf-window": (60, 30)}  # ~5 minutes


def settings_for(name: str) -> settings:
    """CI: a few short derandomized histories; long: many longer ones, a new seed each run."""
    examples, steps = (LONG_BUDGET if LONG else CI_BUDGET)[name]
    return settings(max_examples=int(os.environ.get("CONTINUUM_ORACLE_EXAMPLES", 0)) or examples, stateful_step_count=steps,
                    deadline=None, database=None, derandomize=not LONG, suppress_health_check=list(HealthCheck),
                    print_blob=True)


PROMPTS = ["Once upon a time", "item 3: once upon a time", "Lily saw a big dog.", "The cat", "Tom and Sue went to the"]
SUFFIXES = ["", "", " ok?", " She was", ".", " and"]
TEXTS = [" ok?", " She was", " and the", " 東京", "🤗", "e\u0301", "\n"]
PATTERNS = [r" [0-9]{1,3}", r" (yes|no|maybe)", r"[a-z]{2,5}\."]


def call_strategy(variants: list[str], unbounded: bool, speculation: bool = True):
    """``unbounded``: greedy calls without ``max_tokens`` too (to EOS or the context: on a small llama.cpp pool such
    calls outgrow it beside others and park); ``speculation``: greedy calls with prompt-lookup drafts too (a hybrid
    model refuses them)."""
    v, k, seed, sfx = st.sampled_from(variants), st.integers(0, 6), st.integers(0, 2**16), st.sampled_from(SUFFIXES)
    lookup = [st.builds(Call, kind=st.just("lookup"), k=st.integers(0, 12), variant=v, suffix=sfx)] if speculation else []
    return st.one_of(
        st.builds(Call, kind=st.just("greedy"), k=st.none() | k if unbounded else k, variant=v, suffix=sfx),
        st.builds(Call, kind=st.just("sample"), k=k, seed=seed, variant=v, suffix=sfx),
        st.builds(Call, kind=st.just("fork"), n=st.integers(2, 3), k=st.integers(0, 4), seed=seed, variant=v),
        st.builds(Call, kind=st.just("beam"), n=st.integers(2, 3), k=st.integers(0, 4), variant=v),
        st.builds(Call, kind=st.just("choice"), arg=st.sampled_from(OPTIONS), variant=v, suffix=sfx),
        st.builds(Call, kind=st.just("choice"), arg=st.sampled_from(OPTIONS), variant=v, suffix=st.just(" ok?")),
        st.builds(Call, kind=st.just("regex"), arg=st.sampled_from(PATTERNS), k=st.just(10), variant=v),
        st.builds(Call, kind=st.just("json"), arg=st.sampled_from(sorted(JSON_SCHEMAS)), k=st.just(12), variant=v),
        st.builds(Call, kind=st.just("cfg"), k=st.integers(1, 8), variant=v, suffix=sfx),
        *lookup)


def _kind(name: str) -> str:
    """The GGUF a ``gguf...`` backend name runs (oracle_support.gguf_path)."""
    return "lfm2" if "lfm2" in name else "window" if "window" in name else "gemma" if "gemma" in name else "f32"


def machine_for(name: str):
    """The state machine of one backend (its variants decide the strategies)."""
    hf = not name.startswith(("gguf", "remote"))
    variants = list(hf_backend(name).variants) if hf else ["plain"]
    calls = call_strategy(variants, unbounded=not hf, speculation="lfm2" not in name)

    class Oracle(RuleBasedStateMachine):
        states = Bundle("states")

        def __init__(self):
            super().__init__()
            self.b: Backend = hf_backend(name) if hf else None
            self.dir = tempfile.TemporaryDirectory()

        def teardown(self):
            self.dir.cleanup()

        @initialize(target=states, prompts=st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=2),
                    small=st.booleans(), prefix=st.booleans())
        def start(self, prompts, small, prefix):
            if name.startswith("remote"):  # (one server: whatever it ran before, for every history)
                self.b = remote_backend(name.removeprefix("remote-"))
            elif not hf:  # the pool is the model's: one per history (a KV view never crosses pools)
                self.b = llama_backend(name.endswith("invariant"), small, prefix, _kind(name))
            s = SequenceState.from_prompts(self.b.model, prompts)
            check_state(self.b, s, [0.0] * s.rows)
            return Held(s, [0.0] * s.rows)

        @invariant()
        def window_probes_read_as_the_bytes(self):
            """The sliding-window probe (``gaps.held``) against llama.cpp's own bytes, whatever ran before."""
            if name.startswith("gguf") and "window" in name and self.b is not None:
                from llamacpp_support import check_window_probes

                check_window_probes(self.b.model.pool)

        @rule(target=states, prompt=st.sampled_from(PROMPTS))
        def prompt(self, prompt):
            return Held(SequenceState.from_prompts(self.b.model, prompt), [0.0])

        @rule(target=states, h=states, call=calls)
        def call(self, h, call):
            inp, carried = prepare(h, call)
            out = verify(self.b, call, inp, carried, execute(self.b, call, inp))
            return multiple() if out.final else out

        @rule(target=states, h=states, k=st.integers(0, 60))
        def cut(self, h, k):
            s = h.state
            new = s[chars_key(s, slice(None, k))]
            assert list(new) == [t[:k] for t in s]  # the reference: Python's own slicing of each row's text
            if any(len(ids) == 0 for ids, _ in real_rows(new)):
                return multiple()  # (an empty row cannot be continued: tested elsewhere)
            carried = cut_carried(s, new, h.carried)
            check_state(self.b, new, carried)
            return Held(new, carried)

        @rule(target=states, h=states, text=st.sampled_from(TEXTS))
        def add_text(self, h, text):
            if longest(h.state) > MAX_TOKENS:
                return multiple()  # (the references' contexts bound a state: calls cut theirs, adds stop)
            new = h.state + text
            assert list(new) == [t + self.b.appended(text) for t in h.state]
            check_state(self.b, new, h.carried)
            return Held(new, h.carried)

        @rule(target=states, h=states, k=st.none() | st.integers(1, 40))
        def add_state(self, h, k):
            s = h.state
            if 2 * longest(s) > MAX_TOKENS:
                return multiple()
            other, other_carried = (s, h.carried) if k is None else (s[chars_key(s, slice(None, k))], None)
            if k is not None:
                other_carried = cut_carried(s, other, h.carried)
                check_state(self.b, other, other_carried)  # its weights are carried: they must be right first
            new = s + other
            assert list(new) == [t + o for t, o in zip(s, other)]
            w = other.weights.flatten().tolist()
            carried = [None if c is None or o is None else c + x for c, o, x in zip(h.carried, other_carried, w)]
            check_state(self.b, new, carried)
            return Held(new, carried)

        @rule(target=states, h=states, variant=st.sampled_from(variants))
        def save_load(self, h, variant):
            path = os.path.join(self.dir.name, "state.safetensors")
            h.state.save(path)
            new = SequenceState.load(path, self.b.variants[variant])
            assert [ids for ids, _ in real_rows(new)] == [ids for ids, _ in real_rows(h.state)]
            check_state(self.b, new, h.carried)
            return Held(new, h.carried)

        @rule(target=states, hs=st.lists(states, min_size=2, max_size=3),
              programs=st.lists(st.lists(calls, min_size=1, max_size=2), min_size=3, max_size=3))
        def batch(self, hs, programs):
            done = continuum.run_batch(lambda i: run_program(self.b, hs[i], programs[i]), range(len(hs)), concurrency=3)
            return keep(*[[verify(self.b, *x) for x in d][-1] for d in done])

        @rule(target=states, hs=st.lists(states, min_size=2, max_size=3), cs=st.lists(calls, min_size=3, max_size=3))
        def threads(self, hs, cs):
            jobs = [(c, *prepare(h, c)) for h, c in zip(hs, cs)]
            with ThreadPoolExecutor(len(jobs)) as pool:
                outs = list(pool.map(lambda j: execute(self.b, j[0], j[1]), jobs))
            return keep(*[verify(self.b, c, inp, carried, out) for (c, inp, carried), out in zip(jobs, outs)])

        @rule(target=states, hs=st.lists(states, min_size=2, max_size=3), cs=st.lists(calls, min_size=3, max_size=3))
        def gather(self, hs, cs):
            return keep(*gather(self.b, [(c, *prepare(h, c)) for h, c in zip(hs, cs)]))

        def restart(self, graceful: bool = False):
            """``kill -9`` of a served backend's server (or SIGTERM: ``graceful``), then a start on its port and store
            (not a rule: the stress driver's step, ~3 s): the states held continue by their handles, their stored
            tokens computed again (a GGUF server's store keeps tokens; after a graceful stop, the KV it saved of the
            states in its memory is restored: serve/sidecars.py) or their stored KV loaded (transformers), as checked
            after."""
            if graceful:
                self.b.server.stop()
            else:
                self.b.server.kill9()
            self.b.server.start()
            return multiple()

    Oracle.__name__ = f"Oracle_{name.replace('-', '_')}"
    return Oracle


BACKENDS = ["stories", "tiny", "window", "lfm2", "gguf", "gguf-invariant", "gguf-lfm2", "gguf-window",
            "remote-gguf-window"]  # (served: models.remote on continuum serve, oracle_support.remote_backend)


@pytest.mark.parametrize("name", BACKENDS)
def test_oracle(name):
    if name.startswith(("gguf", "remote")):
        pytest.importorskip("llama_cpp")
        gguf_path(_kind(name))  # (skips without the fixture)
    else:
        hf_backend(name)  # (skips without the fixture)
    run_state_machine_as_test(machine_for(name), settings=settings_for(name))


def tour(m) -> None:
    """One scripted history through every rule and every kind of call (CI runs it whatever hypothesis draws)."""
    a = m.start(prompts=["Once upon a time", "The cat"], small=True, prefix=True)
    b = m.prompt(prompt="Lily saw a big dog.")
    c = m.call(h=b, call=Call("greedy", k=6, variant="prefix" if "prefix" in m.b.variants else "plain"))
    d = m.call(h=c, call=Call("choice", arg=(" yes", " no"), suffix=" ok?"))
    e = m.call(h=a, call=Call("fork", n=2, k=3, seed=1))
    f = m.call(h=e, call=Call("sample", k=3, seed=2, variant="budget" if "budget" in m.b.variants else "plain"))
    m.call(h=b, call=Call("beam", n=3, k=4))
    m.call(h=a, call=Call("regex", arg=PATTERNS[1], k=10))
    many = m.call(h=a, call=Call("choice", arg=OPTIONS[-1], suffix=" ok?"))  # (llama.cpp's small pool: in parts)
    m.call(h=many, call=Call("greedy", k=3))  # (its option tokens left uncached: computed by this call)
    m.call(h=c, call=Call("json", arg="color", k=12))
    if "lfm2" not in m.b.name:  # (a hybrid refuses speculation)
        m.call(h=m.add_text(h=c, text=" and the"), call=Call("lookup", k=10))
    m.call(h=d, call=Call("cfg", k=6))
    y = m.add_text(h=m.cut(h=c, k=12), text=" 東京")
    z = m.add_state(h=c, k=None)
    m.add_state(h=f, k=20)
    w = m.save_load(h=d, variant="plain")
    greedy, pick, sample = Call("greedy", k=5), Call("choice", arg=OPTIONS[1], suffix=" ok?"), Call("sample", k=3, seed=3)
    to_end = Call("greedy", k=None) if m.b.kind == "llama" else greedy  # (on the 256-cell pool: calls park)
    m.batch(hs=[c, d, w], programs=[[pick, to_end], [to_end], [sample, pick]])
    m.threads(hs=[c, c, y], cs=[pick, pick, greedy])
    m.gather(hs=[d, d, z], cs=[greedy, pick, sample])
    m.teardown()


@pytest.mark.parametrize("name", BACKENDS)
def test_oracle_tour(name):
    if name.startswith(("gguf", "remote")):
        pytest.importorskip("llama_cpp")
    tour(machine_for(name)())
