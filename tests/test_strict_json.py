"""Strict JSON by default: closed objects, bounded keys, approximate-then-validate (issue 14).

References: ``jsonschema`` on the ORIGINAL schema (every output, every rewrite), Python's ``re``
for the key patterns, brute force over small alphabets.
"""

from __future__ import annotations

import itertools
import json
import re
import warnings

import jsonschema
import pytest
import torch

from continuum import generate, samplers
from continuum.errors import GeneratorArgumentError, IncompleteGenerationError, SchemaViolationError, UnsupportedSchemaError
from continuum.guides import SchemaCoverageWarning, normalize_schema, prepare_json_schema
from continuum.guides.closing import bounded_key_pattern, excluding_pattern

from conftest import FIXTURES

FIX = FIXTURES / "jsonschemas"

OK = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _walk(guide, text: str, tokenizer) -> bool:
    """Does the guide accept ``text`` (tokenized canonically), token by token, then finish?"""
    state = guide.new_state()
    for t in tokenizer.encode_continuation(text):
        state = guide.advance(state, t)
        if state is None:
            return False
    return guide.is_final(state)


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
def test_open_schema_returns_a_dict_with_no_extra_key_within_50_tokens(model, backend):
    gen = generate.json(model, OK, samplers.multinomial(), backend=backend)
    assert gen.exact
    for seed in range(4):
        value = gen("data: ", max_tokens=50, rng=torch.Generator().manual_seed(seed))
        assert set(value) == {"ok"} and isinstance(value["ok"], bool)
        jsonschema.validate(value, OK)


def test_additional_properties_true_restores_extra_keys(gpt2_model):
    tok = gpt2_model.tokenizer
    closed = generate.json(gpt2_model, OK, backend="llguidance").guide
    opened = generate.json(gpt2_model, OK, backend="llguidance", additional_properties=True).guide
    extra = '{"ok": true, "zz": [1]}'
    assert not _walk(closed, extra, tok) and _walk(opened, extra, tok)
    assert _walk(closed, '{"ok": false}', tok) and _walk(opened, '{"ok": false}', tok)
    # a schema that allows extra keys keeps them, whatever the option
    explicit = {**OK, "additionalProperties": {"type": "integer"}}
    guide = generate.json(gpt2_model, explicit, backend="llguidance").guide
    assert _walk(guide, '{"ok": true, "zz": 3}', tok) and not _walk(guide, '{"ok": true, "zz": "a"}', tok)
    with pytest.raises(GeneratorArgumentError, match="additional_properties"):
        generate.json(gpt2_model, OK, additional_properties="yes")


def test_pydantic_models_follow_the_same_default(gpt2_model):
    from pydantic import BaseModel

    class Item(BaseModel):
        name: str
        tags: dict[str, int]

    prepared = prepare_json_schema(Item, max_string_length=4)
    check = jsonschema.Draft202012Validator(prepared.schema).is_valid
    assert check({"name": "a", "tags": {"abcd": 1}}) and not check({"name": "a", "tags": {}, "x": 1})
    assert not check({"name": "a", "tags": {"abcde": 1}})  # dict keys are bounded too
    guide, tok = generate.json(gpt2_model, Item, max_string_length=4).guide, gpt2_model.tokenizer
    assert _walk(guide, '{"name": "a", "tags": {"abcd": 1}}', tok)
    assert not _walk(guide, '{"name": "a", "tags": {"abcde": 1}}', tok)
    assert not _walk(guide, '{"name": "a", "tags": {}, "x": 1}', tok)


def test_closing_counts_names_declared_in_subschemas():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "anyOf": [{"properties": {"b": {"const": 1}}, "required": ["b"]}, {"required": ["c"]}]}
    prepared = prepare_json_schema(schema)
    closed = jsonschema.Draft202012Validator(prepared.schema)
    for inst in ({"a": 1, "b": 1}, {"c": None}, {"a": 2, "b": 1, "c": 3}):
        assert closed.is_valid(inst) and jsonschema.Draft202012Validator(schema).is_valid(inst)
    assert not closed.is_valid({"b": 1, "d": 0})


@pytest.mark.parametrize("names, n", [(["ab", "ac", "b"], 3), ([], 2), (["", "a.b", "x"], 3), (["abc"], 2)])
def test_excluding_pattern_matches_exactly_the_short_undeclared_names(names, n):
    pattern = re.compile(excluding_pattern(names, n))
    for k in range(n + 2):
        for chars in itertools.product("abc.x", repeat=k):
            s = "".join(chars)
            assert bool(pattern.fullmatch(s)) == (len(s) <= n and s not in names), s


@pytest.mark.parametrize("pattern", ["^x-[a-z]+$", "[0-9]*_id", "^a.*", "b{2,}$", r"^\w+\.[a-c]+$", "^[*+]+$"])
def test_bounded_key_patterns_match_only_keys_the_pattern_matches(pattern):
    bounded = bounded_key_pattern(pattern, 3)
    assert bounded is not None
    hits = 0
    for k in range(9):
        for chars in itertools.product("ab_x-.*1id", repeat=k) if k <= 4 else [("x-", "ab"), ("b",) * k]:
            s = "".join(chars)
            if re.fullmatch(bounded, s):
                hits += 1
                assert re.search(pattern, s), (s, bounded)
                assert len(s) <= 3 * 3 + 8
    assert hits > 0


def test_max_string_length_bounds_extra_and_pattern_keys(gpt2_model):
    tok = gpt2_model.tokenizer
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "additionalProperties": {"type": "boolean"}}
    guide = generate.json(gpt2_model, schema, backend="llguidance", max_string_length=4).guide
    assert _walk(guide, '{"name": "abcd", "zz": true}', tok)
    assert not _walk(guide, '{"name": "abcde"}', tok)  # values (as before)
    assert not _walk(guide, '{"abcde": true}', tok) and not _walk(guide, '{"zz": 1}', tok)  # extra keys
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "patternProperties": {"^x-": {"type": "integer"}}}
    guide = generate.json(gpt2_model, schema, backend="llguidance", max_string_length=4).guide
    assert _walk(guide, '{"name": "abcd", "x-ab": 1}', tok)
    assert not _walk(guide, '{"x-abcdef": 1}', tok)  # pattern keys: each repetition bounded
    assert not _walk(guide, '{"x-a": true}', tok)  # a key the pattern matches keeps its schema
    schema["additionalProperties"] = {"type": "boolean"}
    prepared = prepare_json_schema(schema, max_string_length=4)
    closed, original = jsonschema.Draft202012Validator(prepared.schema), jsonschema.Draft202012Validator(schema)
    for inst in ({"name": "a", "x-": 1, "q": False}, {"x-1": 2}, {"name": "x"}, {"x-a": True}, {"name": 1}):
        assert not closed.is_valid(inst) or original.is_valid(inst), inst
    guide = generate.json(gpt2_model, {"type": "object"}, additional_properties=True, max_string_length=4).guide
    assert _walk(guide, '{"abcd": [1], "b": 2}', tok) and not _walk(guide, '{"abcde": 1}', tok)


APPROX = [
    ({"type": "object", "properties": {"p": {"type": "string", "pattern": "^(?=a)[ab]+$"}}, "required": ["p"]},
     "/properties/p/pattern"),
    ({"type": "object", "properties": {"n": {"type": "integer", "not": {"multipleOf": 3}}}, "required": ["n"]},
     "/properties/n/not"),
    ({"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}, "/oneOf"),
    ({"type": "object", "properties": {"t": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True,
                                             "minItems": 2}}, "required": ["t"]}, "/properties/t/uniqueItems"),
    ({"type": "object", "propertyNames": {"pattern": "^a", "maxLength": 3}, "additionalProperties": {"type": "null"}},
     "/propertyNames"),
]


@pytest.mark.parametrize("schema, path", APPROX, ids=[p for _, p in APPROX])
def test_approximated_schema_warns_and_its_outputs_validate_or_raise(gpt2_model, schema, path):
    with pytest.warns(SchemaCoverageWarning, match=re.escape(path)) as caught:
        gen = generate.json(gpt2_model, schema, samplers.multinomial(), max_string_length=4)
    assert sum(issubclass(w.category, SchemaCoverageWarning) for w in caught) == 1  # ONE warning
    assert not gen.exact and any(path in n for n in gen.not_enforced)
    outcomes = set()
    for seed in range(6):
        try:
            value = gen("value: ", max_tokens=40, rng=torch.Generator().manual_seed(seed))
        except SchemaViolationError as exc:
            assert not jsonschema.Draft202012Validator(schema).is_valid(exc.value)
            outcomes.add("flagged")
        except IncompleteGenerationError:
            outcomes.add("incomplete")
        else:
            jsonschema.validate(value, schema)  # never an invalid value returned silently
            outcomes.add("valid")
    assert outcomes - {"incomplete"}
    with pytest.raises(UnsupportedSchemaError) as info:
        generate.json(gpt2_model, schema, on_unsupported="raise")
    assert info.value.path == path or (info.value.path is None and "llguidance" in str(info.value))  # engine-level
    with pytest.raises(GeneratorArgumentError, match="on_unsupported"):
        generate.json(gpt2_model, schema, on_unsupported="ignore")


def test_approximation_widens_only_the_keyword():
    """Everything but the approximated keyword is still enforced (``minimum`` beside the ``not``)."""
    schema = {"type": "integer", "minimum": 5, "not": {"multipleOf": 3}}
    norm = normalize_schema(schema, approximate=True)
    assert norm.schema == {"type": "integer", "minimum": 5} and [a.keyword for a in norm.approximated] == ["not"]


@pytest.mark.parametrize("names", [{"pattern": "^[ab]+$"}, {"maxLength": 2}, {"enum": ["a", "bb"]}, False])
def test_property_names_become_key_constraints_exactly(names):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "ccc": {}}, "propertyNames": names}
    norm = normalize_schema(schema)
    assert not norm.approximated
    new, old = jsonschema.Draft202012Validator(norm.schema), jsonschema.Draft202012Validator(schema)
    for keys in itertools.chain.from_iterable(itertools.combinations(["a", "bb", "ab", "ccc", ""], r) for r in range(3)):
        for value in (1, "x"):
            inst = {k: value for k in keys}
            assert new.is_valid(inst) == old.is_valid(inst), inst


def test_processors_default_to_raise_and_follow_the_same_defaults(gpt2_model):
    from transformers import LogitsProcessorList

    from continuum.processors import JSONLogitsProcessor

    hf, tok = gpt2_model.model, gpt2_model.tokenizer.hf
    schema = {"type": "integer", "not": {"multipleOf": 3}}
    with pytest.raises(UnsupportedSchemaError, match="/not"):
        JSONLogitsProcessor(schema, tok)
    with pytest.warns(SchemaCoverageWarning, match=r"parse\(text\)"):
        proc = JSONLogitsProcessor(schema, tok, on_unsupported="approximate")
    assert not proc.exact
    with pytest.raises(SchemaViolationError):
        proc.parse("9")
    assert proc.parse("7") == 7
    proc = JSONLogitsProcessor(OK, tok)
    assert proc.exact
    ids = torch.tensor([tok.encode("data: ")])
    for seed in range(3):
        torch.manual_seed(seed)
        proc.reset()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([proc]),
                          max_new_tokens=50, do_sample=True, pad_token_id=tok.eos_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert set(proc.parse(text)) == {"ok"}


@pytest.mark.skipif(not FIX.exists(), reason="../shared/fixtures/jsonschemas is absent")
def test_closing_and_key_bounds_are_sound_on_the_sample():
    """No invalid example of the sample becomes valid once objects are closed and keys bounded."""
    checked = 0
    for path in sorted(FIX.glob("*.jsonl")):
        for line in [ln for ln in path.read_text().split("\n") if ln.strip()][::25]:
            rec = json.loads(line)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    prepared = prepare_json_schema(rec["schema"], max_string_length=8)
                    new = jsonschema.Draft202012Validator(prepared.schema)
                    for inst in rec["valid_examples"] + rec["invalid_examples"]:
                        if new.is_valid(inst):
                            prepared.validate(inst)  # raises if the original schema rejects it
                            checked += 1
                except UnsupportedSchemaError:
                    continue
                except (jsonschema.exceptions.RefResolutionError, RecursionError):
                    continue
    assert checked > 0


def test_llguidance_mask_is_the_brute_force_allowed_set(gpt2_model):
    """The preallocated-bitmask path (numpy masked copy) against advancing every token, with a free
    row, a padded LM head and a non-contiguous / non-float32 input (the torch path)."""
    tok = gpt2_model.tokenizer
    guide = generate.json(gpt2_model, {"type": "object", "properties": {"n": {"type": "integer"}}}, backend="llguidance",
                          whitespace_pattern="").guide
    a = guide.new_state()
    b = guide.advance(guide.new_state(), tok.encode_continuation("{")[0])
    vocab = guide.n_vocab

    def allowed(state):
        out = set()
        for t in range(vocab):
            if guide.advance(guide.copy(state), t) is not None:
                out.add(t)
        if guide.is_final(state):
            out |= set(tok.eos_token_ids)
        return out

    want = [allowed(a), None, allowed(b)]
    for dtype, width in ((torch.float32, vocab), (torch.float32, vocab + 7), (torch.float64, vocab + 7)):
        logits = torch.zeros((3, width), dtype=dtype)
        out = guide.apply_mask(logits, [guide.copy(a), None, guide.copy(b)])
        for row, w in enumerate(want):
            got = set(torch.isfinite(out[row]).nonzero().flatten().tolist())
            assert got == (set(range(width)) if w is None else {t for t in w if t < width}), (dtype, width, row)
