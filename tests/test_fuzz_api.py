"""An API-wide fuzz harness (issue 18): nothing hangs, nothing leaks a raw error.

Hypothesis draws constructor and call arguments for every generator (text, choice, regex, json, cfg;
plain, continuous and streamed) and sampler: wrong types, out-of-range numbers, NaN and infinities,
empty and huge values, unicode edge cases (lone surrogates, NUL, bidi controls), per-row lists of the
wrong length, states of the other model (another tokenizer), forked and sliced states. Each call must

* return a well-formed result (a ``str``/list shaped like the prompts and samples, a parsed value or a
  ``SequenceState``), or raise a :class:`~continuum.ContinuumError` subclass: a raw exception from
  torch, tokenizers, outlines-core, llguidance or jsonschema escaping the public API is a failure;
* finish within a generous bound (:data:`BOUND_S`: a hang is minutes; the compile budget is seconds);
* leave its input states unchanged.

The tally (outcome per error class, distinct inputs tried) is an ``event`` per example (``pytest
--hypothesis-show-statistics``) and, with ``CONTINUUM_FUZZ_TALLY=path``, a JSON file written at the end.
``CONTINUUM_FUZZ_API_EXAMPLES=2000`` runs longer (default: 100 examples, under a minute);
``python -m benchmarks.fuzz_api`` runs the long profile and prints the tallies.
"""

from __future__ import annotations

import json as _json
import math
import os
import time
import warnings
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from continuum import ContinuumError, SequenceState, continuous, generate, samplers

from conftest import check_unchanged, snapshot

EXAMPLES = int(os.environ.get("CONTINUUM_FUZZ_API_EXAMPLES", "100"))
BOUND_S = 60.0
TALLY: Counter = Counter()
SEEN: set = set()
SLOWEST = [0.0, ""]  # seconds, and the arguments of the slowest call


class User(BaseModel):
    name: str
    age: int


def _cyclic() -> dict:
    d: dict = {"type": "array"}
    d["items"] = d
    return d


def _deep(n: int) -> dict:
    d: dict = {}
    for _ in range(n):
        d = {"items": d}
    return d


NAN, INF = float("nan"), float("inf")
SURROGATES = ["\ud800abc", "a\udfff", "\udc80"]
ODD_TEXT = ["", " ", "\n", "\x00", "\x00a\x00", "é", "😀", "\u202e\u202d", "東京", "e\u0301", "\ufeff", "\U0010ffff",
            "Once upon a time", "x" * 1500, *SURROGATES]
NUMBERS = [0, 1, 2, 3, -1, 0.5, 1.5, -0.0, NAN, INF, -INF, 1e308, 10**6, 2**70, True, False, None, "2", [1], complex(1, 1)]

text = st.one_of(st.sampled_from(ODD_TEXT), st.text(max_size=12))


def maybe(default, pool):
    """The default most of the time (so calls get past construction), an odd value otherwise."""
    return st.one_of(st.just(default), st.just(default), st.just(default), pool)


prompts = st.one_of(
    text, st.lists(text, min_size=0, max_size=3), st.tuples(text, text),
    st.sampled_from([None, 3, 1.5, b"bytes", [b"x"], ["a", 3], [None], {"a": 1}, object()]),
    st.tuples(st.just("STATE"), st.sampled_from(["same", "other", "forked", "empty-slice", "cut", "beams"])),
)
sampler_spec = st.one_of(
    st.just(("default",)), st.just(("greedy",)),
    st.tuples(st.just("multinomial"), maybe(1, st.sampled_from(NUMBERS + [4])), maybe(None, st.sampled_from(NUMBERS)),
              maybe(None, st.sampled_from(NUMBERS)), maybe(None, st.sampled_from(NUMBERS))),
    st.tuples(st.just("beam"), maybe(2, st.sampled_from(NUMBERS + [4]))),
    st.tuples(st.just("raw"), st.sampled_from(["greedy", 3, None, torch.zeros(2)])),
)
REGEXES = [r"[0-9]{3}", r"(yes|no)", "", "a{0}", "(", "x^", r"[a-z]{1000000}", r"[a-z]*a[a-z]{40}", r"\d+", "(?=a)a",
           "\\", "a" * 3000, r"\p{L}{1,4}", r"(a|b){1,5}", "\x00", ".{0,3}", "[", "a{99999999999}", r"\b", 3, None,
           "((((((((((a))))))))))", "(" * 400 + "a" + ")" * 400, *SURROGATES]
CHOICES = [["yes", "no"], [], "yes", [""], ["a", "a"], [1, 2], [" yes", "no", "maybe"], None, 5, ["a" * 400, "b"],
           [str(i) for i in range(300)], ["\x00", "é"], ("x", "y"), {"a", "b"}, [["a"]], ["a", None], ["ok", SURROGATES[0]]]
SCHEMAS = [{"type": "integer"}, {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]},
           {"enum": ["a", "b"]}, {}, True, False, "not json", '{"type": "string", "maxLength": 2}', 3, None, [],
           {"type": "strin"}, {"$ref": "#/nope"}, {"$ref": "http://x/y"}, {"not": {"pattern": "^a"}}, _deep(100),
           _cyclic(), {"enum": list(range(20_000))}, {"type": "string", "pattern": "("},
           {"type": "array", "items": {"type": "integer"}, "minItems": 2},
           User, {"type": "number", "minimum": NAN}, {"type": "integer", "minimum": 5, "maximum": 1},
           {"type": "string", "format": "email"}, {"properties": {SURROGATES[0]: {}}},
           {"type": "object", "properties": {"a": {"$ref": "#"}}},
           {"const": SURROGATES[1]}, {"type": "string", "pattern": "^[a-z]{1000000}$"}, {"type": "integer", "multipleOf": 0},
           {"type": "string", "minLength": 10**9}, {"anyOf": []}, {"allOf": [{"type": "string"}, {"type": "integer"}]},
           '{"items":' * 3000 + "{}" + "}" * 3000, int, BaseModel]
SCHEMA_WORDS = ["type", "properties", "items", "enum", "const", "minimum", "maximum", "pattern", "required", "anyOf",
                "oneOf", "allOf", "not", "$ref", "format", "minLength", "maxLength", "additionalProperties", "$defs", "if",
                "then"]
json_value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 3),
                                    st.sampled_from(["string", "integer", "object", "a", "#", "^a$"])),
                          lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(st.sampled_from(SCHEMA_WORDS), inner, max_size=3)),
                          max_leaves=8)
random_schema = st.dictionaries(st.sampled_from(SCHEMA_WORDS), json_value, max_size=4)
GRAMMARS = ['start: "a" | "b"', "", "start: ", "start: /[0-9]+/", 'root ::= "a" | "b"', 'start: a\na: "x" a | "x"',
            "start: /(a{1000}){1000}/", 3, None, '%ignore " "\nstart: "a"', r"start: /\w+/", "start: undefined_rule",
            'start: "' + SURROGATES[0] + '"', "start: /(/", 'start: "a"*\n' * 50]

GOOD_TEXT = ["", " ", "\n", "\x00a", "é", "😀", "\u202e\u202d", "東京", "e\u0301", "\ufeff", "Once upon a time", "a b c."]
good_text = st.one_of(st.sampled_from(GOOD_TEXT), st.text(max_size=8))
# Valid arguments (varied), and odd ones; each example perturbs a few arguments of a valid call, so
# calls get past construction and decoding is fuzzed too.
GOOD = {
    "kind": st.sampled_from(["text", "choice", "regex", "json", "cfg"]),
    "mode": st.sampled_from(["call", "call", "continuous", "stream"]),
    "model": st.sampled_from(["gpt2", "llama"]),
    "sampler": st.sampled_from([("default",), ("greedy",), ("multinomial", 2, 5, 0.9, 0.7), ("multinomial", 1, None, None, 0.0),
                                ("beam", 2), ("beam", 1)]),
    "regex": st.sampled_from([r"[0-9]{3}", r"(yes|no)", r"[a-z]{1,4}", r"[a-z]{1000000}", r"\d+", r"(ab)+c?"]),
    "choices": st.sampled_from([["yes", "no"], [" yes", " no", "maybe"], ["é", "😀", "a b"], ["a", "ab"]]),
    "schema": st.sampled_from([{"type": "integer"}, {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
                               "required": ["a"]}, {"enum": ["a", "b"]}, User, {"type": "array", "items": {"type": "integer"},
                               "maxItems": 2}, {"type": "boolean"}]),
    "grammar": st.sampled_from(['start: "a" | "b"', "start: /[0-9]{1,3}/", 'start: "(" start ")" | "x"']),
    "syntax": st.just("lark"),
    "backend": st.sampled_from(["auto", "auto", "outlines", "llguidance"]),
    "method": st.sampled_from(["exact", "mean", "greedy"]),
    "whitespace_pattern": st.sampled_from([r"[ ]?", "", None]),
    "max_string_length": st.sampled_from([None, 4]),
    "guidance_scale": st.sampled_from([1.0, 1.0, 1.5]),
    "negative_prompt": st.sampled_from([None, None, "bad", ["x", "y"]]),
    "guidance_rescale": st.sampled_from([0.0, 0.5]),
    "cfg_mode": st.sampled_from(["batched", "sequential"]),
    "token_healing": st.sampled_from([False, False, True]),
    "fast_forward": st.sampled_from([True, False]),
    "prompts": st.one_of(good_text, st.lists(good_text, min_size=1, max_size=3),
                         st.tuples(st.just("STATE"), st.sampled_from(["same", "forked", "cut", "beams"]))),
    "max_tokens": st.sampled_from([0, 1, 2, 3, 4]),
    "stop_at": st.sampled_from([None, None, ".", ["\n", "a"], []]),
    "rng": st.sampled_from([None, "generator"]),
}
BAD = {
    "kind": st.sampled_from(["text"]),
    "mode": st.sampled_from(["call"]),
    "model": st.sampled_from(["gpt2"]),
    "sampler": sampler_spec,
    "regex": st.one_of(st.sampled_from(REGEXES), st.text(max_size=8)),
    "choices": st.one_of(st.sampled_from(CHOICES), st.lists(st.text(min_size=0, max_size=4), max_size=4)),
    "schema": st.one_of(st.sampled_from(SCHEMAS), random_schema),
    "grammar": st.sampled_from(GRAMMARS),
    "syntax": st.sampled_from(["gbnf", "bogus", None, 3]),
    "backend": st.sampled_from(["bogus", None, 3, "outlines"]),
    "method": st.sampled_from(["bogus", None, 3]),
    "whitespace_pattern": st.sampled_from(["(", 3, r"\s*", "a+"]),
    "max_string_length": st.sampled_from([0, -1, 1.5, "3", 10**9, True]),
    "guidance_scale": st.sampled_from(NUMBERS),
    "negative_prompt": st.one_of(text, st.lists(text, max_size=3), st.sampled_from([3, [3], b"x", []])),
    "guidance_rescale": st.sampled_from(NUMBERS),
    "cfg_mode": st.sampled_from(["bogus", None, 3]),
    "token_healing": st.sampled_from([1, None, "yes"]),
    "fast_forward": st.sampled_from([0, None, "no"]),
    "prompts": prompts,
    "max_tokens": st.sampled_from([-1, 1.5, "3", True, None, 10**9, NAN, 2**70]),
    "stop_at": st.one_of(text, st.lists(text, max_size=3), st.sampled_from([3, [3], ["a", None], ""])),
    "rng": st.sampled_from(["cuda?", 3, "seed", torch.zeros(1)]),
}
_ODD_KEYS = sorted(k for k in BAD if k not in ("kind", "mode", "model"))


@st.composite
def spec(draw):
    sp = {k: draw(v) for k, v in GOOD.items()}
    for key in draw(st.sets(st.sampled_from(_ODD_KEYS), max_size=3)):
        sp[key] = draw(BAD[key])
    return sp


def _sampler(s):
    kind = s[0]
    if kind == "default":
        return None
    if kind == "greedy":
        return samplers.greedy()
    if kind == "multinomial":
        kw = {k: v for k, v in zip(("top_k", "top_p", "temperature"), s[2:]) if v is not None}
        return samplers.multinomial(s[1], **kw)
    if kind == "beam":
        return samplers.beam_search(s[1])
    return s[1]


def _build(model, sp):
    common = dict(guidance_scale=sp["guidance_scale"], negative_prompt=sp["negative_prompt"],
                  guidance_rescale=sp["guidance_rescale"], cfg_mode=sp["cfg_mode"], token_healing=sp["token_healing"])
    sampler = _sampler(sp["sampler"])
    kind = sp["kind"]
    if kind == "text":
        return generate.text(model, sampler, **common)
    constrained = dict(common, fast_forward=sp["fast_forward"], backend=sp["backend"])
    if kind == "regex":
        return generate.regex(model, sp["regex"], sampler, **constrained)
    if kind == "choice":
        return generate.choice(model, sp["choices"], sampler, method=sp["method"], **constrained)
    if kind == "json":
        return generate.json(model, sp["schema"], sampler, whitespace_pattern=sp["whitespace_pattern"],
                             max_string_length=sp["max_string_length"], **constrained)
    return generate.cfg(model, sp["grammar"], sampler, syntax=sp["syntax"], **constrained)


def _inputs(sp, model, other):
    p = sp["prompts"]
    if not (isinstance(p, tuple) and len(p) == 2 and p[0] == "STATE"):
        return p, []
    which = p[1]
    base = SequenceState.from_prompts(other if which == "other" else model, ["Once upon", "a"])
    if which == "forked":
        base = continuous(generate.text(model, samplers.multinomial(2)))(base, max_tokens=2, rng=torch.Generator().manual_seed(0))
    elif which == "beams":
        base = continuous(generate.text(model, samplers.beam_search(2)))(base, max_tokens=2)
    elif which == "empty-slice":
        base = base[..., 2:2]
    elif which == "cut":
        base = continuous(generate.text(model, samplers.greedy()))(base, max_tokens=3)[..., :-1]
    return base, [base]


def _rng(value):
    return torch.Generator().manual_seed(1) if value == "generator" else value


def _well_formed(sp, inputs, result, samples: int) -> None:
    if isinstance(result, SequenceState):
        assert result.batch >= 1 and result.samples >= 1 and len(list(result)) == result.batch * result.samples
        return
    if sp["kind"] == "text" and samples == 1:
        if isinstance(inputs, str):
            assert isinstance(result, str)
        else:
            assert isinstance(result, list) and all(isinstance(r, str) for r in result)


def _tally(outcome: str, sp) -> None:
    TALLY[outcome] += 1
    SEEN.add(repr(sorted((k, repr(v)[:300]) for k, v in sp.items())))
    event(outcome)


@pytest.fixture(scope="module", autouse=True)
def _write_tally():
    yield
    path = os.environ.get("CONTINUUM_FUZZ_TALLY")
    if path:
        with open(path, "w") as f:
            _json.dump({"examples": sum(TALLY.values()), "distinct_inputs": len(SEEN), "outcomes": dict(TALLY),
                        "slowest_call_s": round(SLOWEST[0], 2), "slowest_call": SLOWEST[1]}, f, indent=1)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sp=spec())
def test_every_call_returns_or_raises_a_continuum_error(gpt2_model, llama_model, sp):
    model, other = (gpt2_model, llama_model) if sp["model"] == "gpt2" else (llama_model, gpt2_model)
    note(repr({k: (repr(v)[:200]) for k, v in sp.items()}))
    inputs, states = _inputs(sp, model, other)
    snaps = [snapshot(s) for s in states]
    t = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gen = _build(model, sp)
            kw = dict(max_tokens=sp["max_tokens"], stop_at=sp["stop_at"], rng=_rng(sp["rng"]))
            if sp["mode"] == "call":
                result = gen(inputs, **kw)
            elif sp["mode"] == "continuous":
                result = continuous(gen)(inputs, **kw)
            else:
                stream = continuous(gen).stream(inputs, **kw)
                chunks = list(stream)
                result = stream.state
                assert all(isinstance(c, (str, list)) for c in chunks)
        _well_formed(sp, inputs, result, gen.sampler.samples)
        outcome = "ok"
    except ContinuumError as exc:
        outcome = type(exc).__name__
        assert str(exc).strip(), "an error must say something"
    except Exception as exc:  # a raw exception escaped the public API
        raise AssertionError(f"raw {type(exc).__name__} escaped the API: {exc!s:.500}") from exc
    took = time.perf_counter() - t
    if took > SLOWEST[0]:
        SLOWEST[:] = [took, f"{outcome}: " + repr({k: repr(v)[:80] for k, v in sp.items()})]
    assert took < BOUND_S, f"a call took {took:.1f} s"
    for s, snap in zip(states, snaps):
        check_unchanged(s, snap)
    _tally(outcome, sp)


def test_the_tally_saw_errors_and_successes():
    """Runs after the fuzz test: the harness exercised both sides (a harness that only errors tests little)."""
    if not TALLY:
        pytest.skip("the fuzz test did not run in this session")
    assert TALLY["ok"] > 0 and sum(v for k, v in TALLY.items() if k != "ok") > 0, dict(TALLY)
    assert not math.isnan(SLOWEST[0])


INDEXES = [0, -1, 1, 5, 2**70, -(2**70), 1.5, None, "a", True, slice(None), slice(1, 3), slice(None, None, 2),
           slice(None, None, -1), slice(2, 2), slice(0, 10**9), [0], [], [0, 0], [5], Ellipsis, NAN, torch.tensor(0)]
state_arg = st.one_of(text, st.lists(text, max_size=3), st.sampled_from([3, None, b"x", 1.5, ["a", 3], object()]),
                      st.tuples(st.just("STATE"), st.sampled_from(["same", "other", "forked", "empty-slice", "cut", "beams"])))


@settings(max_examples=max(20, EXAMPLES // 2), deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(which=st.sampled_from(["same", "forked", "cut", "beams", "empty-slice"]),
       op=st.sampled_from(["add", "radd", "index", "stack"]), arg=state_arg,
       index=st.lists(st.sampled_from(INDEXES), min_size=1, max_size=4), model_name=st.sampled_from(["gpt2", "llama"]))
def test_state_operations_return_or_raise_a_continuum_error(gpt2_model, llama_model, which, op, arg, index, model_name):
    """``state + x``, ``x + state``, ``state[...]`` and ``SequenceState.stack`` with odd arguments."""
    model, other = (gpt2_model, llama_model) if model_name == "gpt2" else (llama_model, gpt2_model)
    state, _ = _inputs({"prompts": ("STATE", which)}, model, other)
    operand, extra = _inputs({"prompts": arg}, model, other)
    snaps = [snapshot(s) for s in [state, *extra]]
    try:
        if op == "add":
            result = state + operand
        elif op == "radd":
            result = operand + state
        elif op == "index":
            result = state[tuple(index)] if len(index) > 1 else state[index[0]]
        else:
            result = SequenceState.stack([state, operand] if not isinstance(operand, list) else [state, *operand])
        if isinstance(result, SequenceState):
            assert len(list(result)) == result.batch * result.samples
        else:  # an int chars index reads one character per row (docs/state.md)
            assert op == "index" and isinstance(result, (str, list)), type(result)
        outcome = "state-ok"
    except ContinuumError as exc:
        outcome = "state-" + type(exc).__name__
    except Exception as exc:
        raise AssertionError(f"raw {type(exc).__name__} escaped a state operation: {exc!s:.500}") from exc
    for s, snap in zip([state, *extra], snaps):
        check_unchanged(s, snap)
    _tally(outcome, {"which": which, "op": op, "arg": arg, "index": index, "model": model_name})
