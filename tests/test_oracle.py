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
also draws the histories that hit the known bugs below at once. Every bug it finds becomes a named regression test
below.
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, rule, run_state_machine_as_test
from oracle_support import (
    JSON_SCHEMAS,
    MAX_TOKENS,
    Backend,
    Call,
    Held,
    check_choice,
    check_greedy,
    check_state,
    cut_carried,
    execute,
    gather,
    gguf_path,
    hf_backend,
    keep,
    llama_backend,
    longest,
    option_scores,
    own_llama,
    prepare,
    real_rows,
    remote_backend,
    run_program,
    verify,
)

import continuum
from continuum import SequenceState, continuous, generate, samplers

from conftest import chars_key

LONG = os.environ.get("CONTINUUM_ORACLE") == "long"
# Histories that hit a known bug (an xfail regression below) at once are drawn only with CONTINUUM_ORACLE_KNOWN=1, so
# that the long profile finds new ones. None now: greedy calls without max_tokens on llama.cpp (several rows to the
# context outgrowing a pool together: test_a_call_of_two_rows_to_the_context_of_a_small_pool_regression) are drawn too.
# The spilled fork family that the long profile found in both modes (each member's bytes holding its own copy of the
# shared prefix, refused with "no room to restore a spilled state" though it fitted resident) shares the prefix again
# on restore (models/llamacpp/reshare.py; test_llamacpp_pool.py::test_a_spilled_fork_family_*, and a member spilled
# beside a resident relative: test_a_member_spilled_beside_a_resident_relative_*).
# Both one-offs of the sixth session are explained: "no room to restore a spilled state of 255 tokens" was a short cut
# of a dropped long state restoring its whole bytes (cut back now: test_llamacpp_pool.py::test_a_spilled_state_whose_
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
OPTIONS = [(" yes", " no"), (" the", " there", " then"), (" a", " an", " and"), (" cat", " cats", " dog"),
           (" happy", " sad", " hap"), ("!", ".", "?"), (" ok",), (" once upon", " once", " one"),
           tuple(f" {i}" for i in range(10, 80))]  # (70 options: more paths than a small pool's ids, 64+ tree nodes)
SUFFIXES = ["", "", " ok?", " She was", ".", " and"]
TEXTS = [" ok?", " She was", " and the", " 東京", "🤗", "e\u0301", "\n"]
PATTERNS = [r" [0-9]{1,3}", r" (yes|no|maybe)", r"[a-z]{2,5}\."]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads on a shared 2-core machine (see test_properties)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


# --------------------------------------------------------------------------------------------- regressions
@pytest.mark.parametrize("backend", ["stories", "stories-prefix", "gguf", "gguf-invariant"])
def test_choice_same_state_twice_regression(backend):
    """Issue 56: a greedy choice took a worse option depending on what ran before; the same state picked twice got
    two answers. 12 items x 3 rounds of text -> `` ok?`` -> choice, each choice against the reference's argmax."""
    if backend.startswith("gguf"):
        pytest.importorskip("llama_cpp")
    b = hf_backend("stories") if backend.startswith("stories") else llama_backend(backend.endswith("invariant"), False, False)
    model = b.variants["prefix" if backend.endswith("prefix") else "plain"]
    text = continuous(generate.text(model, samplers.greedy()))
    pick = continuous(generate.choice(model, [" yes", " no"]))
    answers: dict[tuple, set] = {}
    for _ in range(3):
        for x in range(12):
            s = text(f"item {x}: once upon a time", max_tokens=6) + " ok?"
            c = pick(s)
            check_choice(b, s, c, [" yes", " no"])
            answers.setdefault(tuple(real_rows(s)[0][0]), set()).add(c.value)
    assert all(len(v) == 1 for v in answers.values()), answers


# (found by the oracle, fixed in state/convert.py: a state of one LlamaCpp continued on another instance of the same
# GGUF (same fingerprint) raised BackendError 'a KV view of another llama.cpp model (or pool)'; it is recomputed there)
def test_llamacpp_state_on_another_instance_of_the_same_gguf_regression():
    pytest.importorskip("llama_cpp")
    a, other = llama_backend(False, False, False), llama_backend(False, True, False)
    s = continuous(generate.text(a.model, samplers.greedy()))("Once upon a time", max_tokens=6) + " The dog"
    out = continuous(generate.text(other.model, samplers.greedy()))(s, max_tokens=6)
    n = len(real_rows(s)[0][0])
    check_state(a, out, [0.0])
    check_greedy(a, out, [n], [real_rows(s)[0][0]])


def test_oracle_fails_on_a_wrong_choice():
    """The oracle can fail: a choice whose row holds the reference's worse option is refused."""
    b = hf_backend("stories")
    s = SequenceState.from_prompts(b.model, "Once upon a time, there was a little girl named Lily. She was very")
    _, scores = option_scores(b, s, [" happy", " xylophone"])
    assert scores[0][0] - scores[0][1] > 1e-3
    wrong = continuous(generate.choice(b.model, [" xylophone"]))(s)
    with pytest.raises(AssertionError, match="reference's best"):
        check_choice(b, s, wrong, [" happy", " xylophone"])


# (found by the oracle, fixed in models/llamacpp/decode.py and tree.py: on a 256-cell pool, a held state generated to
# the context fills the pool; continuing a cut of it (a choice, or text) raised KVCacheFullError 'no free KV cell for
# 3 new tokens': the held state was pinned as the fork's source, though the fork alone reads its cells; now the rest of
# it is spilled. Both modes, text too: tests/test_llamacpp_pool.py)
def test_continue_a_cut_of_a_pool_filling_state_regression():
    b = own_llama(256)  # (a pool of its own: this one ends full)
    m = b.model
    s = continuous(generate.text(m, samplers.greedy()))("Once upon a time", max_tokens=None)
    assert s.finish_reasons == [["context"]] and len(real_rows(s)[0][0]) == m.llama.n_ctx  # every cell
    cut = s[..., :60] + " ok?"
    out = continuous(generate.choice(m, list(OPTIONS[1])))(cut)
    check_state(b, out, [0.0])
    check_choice(b, cut, out, list(OPTIONS[1]))


# (found by the oracle, fixed in models/llamacpp/window.trim: the cells of a dropped state were not given back while an
# earlier state of its line was held (a 2-row state generated to the context on a 1024-cell pool, dropped: 1023 cells
# still in use; continuing the ancestor raised KVCacheFullError): a sequence's tail is now cut when the longest view
# reaching it is dropped. Both modes: tests/test_llamacpp_pool.py)
def test_cells_of_a_dropped_state_come_back_regression():
    import gc

    b = own_llama(1024)  # (a pool of its own)
    text = continuous(generate.text(b.model, samplers.greedy()))
    a = text(["Once upon a time", "The cat"], max_tokens=3)
    held = text(a, max_tokens=2)  # (without this state in between, the cells come back)
    full = text(held + ".", max_tokens=None)
    assert full.finish_reasons == [["context"], ["context"]]  # 2 x 512 tokens: every cell
    del full
    gc.collect()
    out = text(a, max_tokens=2)
    check_state(b, out, [0.0, 0.0])
    check_greedy(b, out, [len(ids) for ids, _ in real_rows(a)], [ids for ids, _ in real_rows(a)])


# (found by the oracle, fixed in loop/decoding.py (turns.apart): on a 256-cell llama.cpp pool one call of 2 rows
# without max_tokens (greedy to the context: 2 x 256 positions) raised KVCacheFullError 'no free KV cell for 2 new
# tokens' once its rows outgrew the pool together, though each row alone fits: a call alone cannot be parked, and only
# calls with max_tokens are split by cells up front. Its rows now run again as parts, the engine parking what does not fit)
def test_a_call_of_two_rows_to_the_context_of_a_small_pool_regression():
    b = own_llama(256)  # (a pool of its own)
    s = SequenceState.from_prompts(b.model, ["Once upon a time"] * 2)
    out = continuous(generate.text(b.model, samplers.greedy()))(s, max_tokens=None)
    assert out.finish_reasons == [["context"], ["context"]]
    check_state(b, out, [0.0, 0.0])
    check_greedy(b, out, [len(ids) for ids, _ in real_rows(s)], [ids for ids, _ in real_rows(s)])
    one = SequenceState.from_prompts(b.model, "Once upon a time")  # a prompt's independent samples: the same
    seeded = torch.Generator().manual_seed(0)
    forks = continuous(generate.text(b.model, samplers.multinomial(2)))(one, max_tokens=None, rng=seeded)
    assert forks.finish_reasons == [["context", "context"]]
    check_state(b, forks, [0.0, 0.0])
    assert list(s) == ["Once upon a time"] * 2  # (the input, untouched)


def empty_row(backend: str):
    """A BOS-only state (``state[..., :0]``) on stories260K: transformers or the f32 GGUF."""
    b = hf_backend("stories") if backend == "stories" else llama_backend(False, False, False)
    return b, SequenceState.from_prompts(b.model, "Once upon a time")[..., :0]


# (found by the oracle, fixed in loop/scoring.py: at the start of an empty (BOS-only) row on the stories260K
# SentencePiece vocabulary a choice over [' yes', ' no'] scored and appended the options without their leading space,
# ids [1, 297, 414], value 'no', where state + ' no' is [1, 410, 297, 414], text ' no')
@pytest.mark.parametrize("backend", ["stories", "gguf"])
def test_choice_at_the_start_of_an_empty_row_regression(backend):
    b, empty = empty_row(backend)
    c = continuous(generate.choice(b.model, [" yes", " no"]))(empty)
    assert c.value in [" yes", " no"]
    check_choice(b, empty, c, [" yes", " no"])


# (found by the oracle, fixed in loop/decoding.py (state/combine.lead_space): at the start of an empty (BOS-only) row
# on the stories260K vocabulary a regex ' [0-9]{1,3}' step's tokens spelled ' 200' ([410, 479, 477, 477], 410 the
# space piece) but its value and text read '200': SentencePiece's decoder drops a row's first leading space)
@pytest.mark.parametrize("backend", ["stories", "gguf"])
def test_regex_at_the_start_of_an_empty_row_regression(backend):
    import re

    b, empty = empty_row(backend)
    r = continuous(generate.regex(b.model, r" [0-9]{1,3}"))(empty, max_tokens=10)
    check_state(b, r, [0.0])
    assert re.fullmatch(r" [0-9]{1,3}", r.value), r.value


# (found by the oracle, timing-dependent, fixed in models/llamacpp/backend.py: asyncio.gather of text, forks, beams and
# choices on a 256-cell pool while earlier states are held failed with KVCacheFullError ('no room to restore a spilled
# state of 57 tokens'): a choice's token tree decoded in the same step as a call's new forks made room by spilling
# them (not yet held), and their restore apart no longer fit. Now a step holds what it decoded; the deterministic
# variant: tests/test_llamacpp_pool.py::test_a_step_keeps_the_forks_it_made_resident_while_a_token_tree_makes_room)
@pytest.mark.parametrize("invariant", [False, True])
def test_concurrent_calls_on_a_small_pool_regression(invariant):
    import random

    b = own_llama(256, invariant)
    calls = [Call("greedy", k=6), Call("fork", n=3, k=4, seed=1), Call("beam", n=3, k=4), Call("choice", arg=OPTIONS[1])]
    first, inp = Call("greedy", k=40), SequenceState.from_prompts(b.model, ["Once upon a time", "The cat"])
    rnd, held = random.Random(0), [verify(b, first, inp, [0.0, 0.0], execute(b, first, inp))]
    for _ in range(60):
        jobs = [(c, *prepare(h, c)) for h, c in zip(rnd.choices(held, k=3), rnd.choices(calls, k=3))]
        held += [h for h in gather(b, jobs) if longest(h.state) < 120]


def test_continue_a_cut_of_a_fork_merged_with_another_call_regression():
    b = hf_backend("tiny")
    s0 = SequenceState.from_prompts(b.model, ["Once upon a time"] * 2)
    fork, sample = Call("fork", n=3, k=4, seed=0), Call("sample", k=1, seed=0)
    for _ in range(3):
        s1, _ = gather(b, [(fork, s0, [0.0, 0.0]), (Call("greedy", k=2), s0, [0.0, 0.0])])
        cut = s1.state[:, :, :26]
        verify(b, sample, cut, cut_carried(s1.state, cut, s1.carried), execute(b, sample, cut))


# (found by the long oracle, gguf profile, a 1,024-cell pool with the prefix cache on: three unbounded greedy acalls
# gathered; at position 361 of a 512-token text the reference's top-2 gap is 0.078 and continuum took the second.
# Not a wrong cache: every K value of the row's cells is within one f16 step of llama-cpp-python's prefill, as are
# those of llama-cpp-python's own one-token-at-a-time evaluation, which moves that gap to 0.040. The margin compared
# was DECODE_TOL, where each of the two logits may move by DECODE_TOL (docs/llamacpp.md#exactness): now twice it.)
def test_greedy_margin_regression():
    b = llama_backend(False, False, True)
    h0 = Held(SequenceState.from_prompts(b.model, ["Lily saw a big dog."]), [0.0])
    first = [Call("json", k=12, arg="small"), Call("choice", arg=(" yes", " no"), suffix=" ok?")]
    h1, h2 = gather(b, [(c, *prepare(h0, c)) for c in first])
    greedy = [Call("greedy", k=None), Call("greedy", k=None), Call("greedy", k=None, suffix=".")]
    out = gather(b, [(c, *prepare(h, c)) for h, c in zip([h2, h2, h1], greedy)])
    assert [len(real_rows(h.state)[0][0]) for h in out] == [512] * 3  # (to the context: the long texts it was found on)


# (found by the stress driver, tests/test_oracle_stress.py, stories GGUF on a 256-cell pool: a choice on two rows, a
# 57-token view of a spilled 134-token state beside a 62-token view of a resident 135-token one, failed with
# KVCacheFullError 'no room to restore a spilled state of 134 tokens': the token tree restored the whole spilled
# sequence where a decode forks only the view's positions from its bytes (window.fork_spilled). Now the tree does too.)
def test_a_choice_on_a_short_view_of_a_long_spilled_state_restores_only_the_view_regression():
    b = own_llama(256)
    greedy = Call("greedy", k=140)
    longer = verify(b, greedy, inp := SequenceState.from_prompts(b.model, "Once upon a time"), [0.0],
                    execute(b, greedy, inp))
    short = longer.state[chars_key(longer.state, slice(None, 30))]
    assert b.model.pool.spill_idle() >= 1 and longer.state._kv.views[0].seq.id is None
    other = verify(b, greedy, inp := SequenceState.from_prompts(b.model, "The cat sat on the mat"), [0.0],
                   execute(b, greedy, inp))
    cut = other.state[chars_key(other.state, slice(None, 40))]
    both = SequenceState.stack([short, cut])
    assert longest(longer.state) + longest(other.state) > 256  # (both sequences whole do not fit the pool)
    choice = Call("choice", arg=OPTIONS[0])
    verify(b, choice, both, [0.0, 0.0], execute(b, choice, both))


# (found by the stress driver on the LFM2 GGUF, a 256-cell pool: a run_batch program's greedy call on two rows, 65-
# and 58-token views of spilled 146- and 139-token states, was refused 'no room to restore a spilled state of 139
# tokens'. A hybrid's bytes cannot be cut (its recurrent summary is at their end), so each row restores its whole
# sequence, 285 cells together; the call's rows were priced at their 78-token width and not split. Now a row is priced
# at least at what its sequence takes resident (model.row_cells, loop/turns.py): the rows run as parts.)
def test_short_views_of_long_spilled_hybrid_states_run_apart_regression():
    pytest.importorskip("llama_cpp")
    gguf_path("lfm2")
    b = own_llama(256, kind="lfm2")
    first, then, cuts, longs = Call("greedy", k=60), Call("greedy", k=70), [], []
    for prompt in ("Once upon a time", "The cat sat on the mat"):
        inp = SequenceState.from_prompts(b.model, prompt)
        cuts.append(verify(b, first, inp, [0.0], execute(b, first, inp)).state)  # (a snapshot where it ends)
        longs.append(verify(b, then, cuts[-1], [0.0], execute(b, then, cuts[-1])))  # (its sequence extended)
        b.model.pool.spill_idle()
    assert sum(longest(h.state) for h in longs) > 256 and all(c._kv.views[0].seq.id is None for c in cuts)
    both, more = SequenceState.stack(cuts), Call("greedy", k=12)
    verify(b, more, both, [0.0, 0.0], execute(b, more, both))


# (found by the stress driver on the LFM2 GGUF, 256 cells: three samples of one state, spilled, continued together:
# a hybrid's fork family restores apart, each member its own copy of their common prefix (reshare cannot share a
# recurrent sequence's cells), 3 x 93 cells, refused 'no room to restore a spilled state of 93 tokens'. A call refused
# for room running alone now computes such rows from their tokens instead (setup.recompute_costly), their common
# prefix decoded once: 60 + 3 x 33 cells.)
def test_a_spilled_hybrid_fork_family_is_recomputed_not_refused_regression():
    pytest.importorskip("llama_cpp")
    gguf_path("lfm2")
    b = own_llama(256, kind="lfm2")
    inp = SequenceState.from_prompts(b.model, "Once upon a time, there was a little girl named Lily. " * 3)
    fork = Call("fork", n=3, k=40, seed=3)
    fam = verify(b, fork, inp, [0.0], execute(b, fork, inp))
    b.model.pool.spill_idle()
    assert 3 * longest(fam.state) > 256 and all(v.seq.id is None for v in fam.state._kv.views)
    more = Call("sample", k=3, seed=5)
    verify(b, more, fam.state, fam.carried, execute(b, more, fam.state))


# (found by the stress driver on the LFM2 GGUF, 256 cells: a 3-sample state continued by multinomial(3) needed its
# shared prefix and 3 x (own tokens + new) cells, more than the pool; a fresh draw's samples were split into seeded
# groups, a state's own were not, and the call was refused as 'a prompt that cannot fit alone'. Splitting them needed
# the family's true cells (model.rows_cells: the fork's shared prefix once): priced by the sum of their tokens,
# families that fit were split too and their seeded draws changed.)
# (Its first version sliced a 2-prompt state's rows as state[b:b + 1, :], a SlicingError on samples > 1: the stress
# driver, seed 61, history 39.)
@pytest.mark.parametrize("prompts", [1, 2])
def test_a_state_s_own_samples_that_cannot_continue_together_run_in_groups_regression(prompts):
    pytest.importorskip("llama_cpp")
    gguf_path("lfm2")
    b = own_llama(256, kind="lfm2")
    fams, carried = [], []
    for text in ["Once upon a time, there was a little girl named Lily. ", "The cat sat on the mat and looked out. "][:prompts]:
        inp = SequenceState.from_prompts(b.model, text * 2)
        fork = Call("fork", n=3, k=60, seed=3)
        fam = verify(b, fork, inp, [0.0], execute(b, fork, inp))
        shared = longest(inp)
        assert shared + 3 * (longest(fam.state) - shared) <= 256 < shared + 3 * (longest(fam.state) - shared + 26)
        fams.append(fam.state)
        carried += fam.carried
    both, more = SequenceState.stack(fams), Call("sample", k=26, seed=5)
    verify(b, more, both, carried, execute(b, more, both))


# (found by the stress driver on the window-8 GGUF, 256 cells, seed 7, history 1: six samples of two prompts, spilled,
# continued by one call, were priced with each prompt's common prefix once (model.rows_cells) and fitted; restored, a
# member shared that prefix with a resident relative only from 16 positions on (reshare.MIN_CELLS), and theirs were
# 12-13: restored apart they outgrew the pool mid-call, 'no free KV cell for 6 new tokens'. Any common prefix is
# shared now, as the price assumes.)
@pytest.mark.parametrize("kind", ["f32", "window"])
def test_a_spilled_fork_family_with_a_short_common_prefix_is_restored_shared_regression(kind):
    pytest.importorskip("llama_cpp")
    b = own_llama(256, kind=kind)
    fams, carried = [], []
    for text in ["Once upon a time", "The cat sat"]:
        inp = SequenceState.from_prompts(b.model, text)
        fork = Call("fork", n=3, k=30, seed=11)
        fam = verify(b, fork, inp, [0.0], execute(b, fork, inp))
        fams.append((longest(inp), fam.state))
        carried += fam.carried
    both, more = SequenceState.stack([f for _, f in fams]), Call("sample", k=10, seed=5)
    shared = sum(p + 3 * (longest(f) - p) for p, f in fams)  # (what the call is priced at: each prefix once)
    apart = sum(3 * longest(f) for _, f in fams)
    assert max(p for p, _ in fams) < 16 and shared + 6 * 10 <= 256 < apart + 6 * 10
    b.model.pool.spill_idle()
    assert all(v.seq.id is None for v in both._kv.views)
    verify(b, more, both, carried, execute(b, more, both))
