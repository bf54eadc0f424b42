"""Constraints: vocabulary bytes, regex / choice / JSON outputs over many seeds, errors."""

from __future__ import annotations

import json
import math
import re
from enum import Enum
from typing import Annotated

import pytest
import torch
from pydantic import BaseModel, Field, StringConstraints

from continuum import continuous, generate, samplers
from continuum.errors import EmptyChoicesError, IncompleteGenerationError, InvalidRegexError, UnsupportedSchemaError
from continuum.guides import escape

SEEDS = range(12)


def test_vocabulary_bytes_roundtrip_real_tokenizers(real_tokenizer_model):
    """Concatenating the vocabulary bytes of a row's tokens gives the row's UTF-8 text."""
    tok = real_tokenizer_model.tokenizer
    vocab_bytes = {}
    for token, idx in tok.hf.get_vocab().items():
        vocab_bytes[idx] = tok.token_bytes(token)
    for text in ["Hello world", "Ça va? naïve façade", "東京は日本の首都です", "🤗🦙👍🏽 ok", "a  b\n\tc"]:
        ids = tok.encode_continuation(text)
        data = b"".join(vocab_bytes[i] for i in ids)
        assert data.decode("utf-8") == text or data.decode("utf-8") == " " + text  # SentencePiece "▁" prefix


def test_vocabulary_excludes_special_tokens(model):
    vocab = model.tokenizer.vocabulary
    eos = model.tokenizer.eos_token_id
    assert vocab.get_eos_token_id() == eos


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]+", r"(yes|no|maybe)", r"[0-9]{1,3}\.[0-9]{2}", r"[A-Z][a-zé ]{2,8}!"])
def test_regex_outputs_match(model, pattern):
    gen = generate.regex(model, pattern, samplers.multinomial(3))
    for seed in range(4):
        outs = gen(["Answer: ", "Q"], max_tokens=24, rng=torch.Generator().manual_seed(seed))
        for row in outs:
            for out in row:
                assert re.fullmatch(pattern, out), (pattern, out)


def test_regex_with_multibyte_characters(real_tokenizer_model):
    pattern = r"(café|東京|🤗) [a-c]{2}"
    gen = generate.regex(real_tokenizer_model, pattern, samplers.multinomial(4))
    for seed in range(3):
        for out in gen("x", max_tokens=20, rng=torch.Generator().manual_seed(seed)):
            assert re.fullmatch(pattern, out), out


@pytest.mark.parametrize("method", ["exact", "greedy"])
def test_choice_outputs_are_options(model, method):
    options = ["Positive", "Negative", "Neutral ☺", "東京"] if method == "greedy" else ["a", "b", "c", "d"]
    gen = generate.choice(model, options, samplers.multinomial(4), method=method)
    seen = set()
    for seed in SEEDS:
        for row in gen(["Review: great!\nSentiment: ", "x"], rng=torch.Generator().manual_seed(seed)):
            assert all(o in options for o in row)
            seen.update(row)
    assert len(seen) >= 2  # sampling explores the options
    assert generate.choice(model, options, samplers.greedy(), method=method)("Sentiment: ") in options


def test_choice_with_prefix_options(model):
    gen = generate.choice(model, ["a", "ab", "abc"], samplers.multinomial())
    for seed in SEEDS:
        assert gen("x", rng=torch.Generator().manual_seed(seed)) in {"a", "ab", "abc"}


class Color(str, Enum):
    red = "red"
    green = "green"


class Address(BaseModel):
    city: str = Field(max_length=8)
    zip: int


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int
    height: float
    color: Color
    tags: list[Annotated[str, StringConstraints(max_length=4)]] = Field(max_length=3)
    address: Address
    nickname: str | None = Field(default=None, max_length=5)


SCHEMAS = [
    {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "boolean"}}, "required": ["x", "y"]},
    {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]}, "n": {"type": "integer", "maxDigits": 3}},
     "required": ["kind"]},
]


@pytest.mark.parametrize("backend", ["outlines", "llguidance"])
def test_json_pydantic_outputs_validate(model, backend):
    gen = generate.json(model, Person, samplers.multinomial(2), backend=backend)
    complete = 0
    for seed in range(6):
        state = continuous(gen)(["Person: ", "JSON"], max_tokens=160, rng=torch.Generator().manual_seed(seed))
        try:
            values = state.value
        except IncompleteGenerationError as err:
            assert "max_tokens=160" in str(err)
            continue
        for row in values:
            for person in row:
                assert isinstance(person, Person)
                complete += 1
    assert complete > 0


@pytest.mark.parametrize("backend", ["outlines", "llguidance"])
@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_outputs_validate(model, schema, backend):
    """Complete outputs validate (llguidance follows the schema: extra properties are allowed where
    the schema allows them, so a random model may wander off and hit max_tokens)."""
    import jsonschema

    gen = continuous(generate.json(model, schema, samplers.multinomial(3), backend=backend))
    complete = 0
    for seed in range(4):
        state = gen("data: ", max_tokens=60, rng=torch.Generator().manual_seed(seed))
        for i in range(state.samples):
            try:
                value = state[i, :].value
            except IncompleteGenerationError:
                assert backend == "llguidance" and "additionalProperties" not in schema
                continue
            jsonschema.validate(value, schema)
            complete += 1
    assert complete > 0


def test_unenforced_schema_keywords_warn(model):
    from continuum.guides import SchemaCoverageWarning

    schema = {"type": "object", "properties": {"minimum": {"type": "integer", "minimum": 0}}}
    with pytest.warns(SchemaCoverageWarning, match="minimum"):
        generate.json(model, schema, backend="outlines")


def test_schema_workarounds_for_outlines_core_gaps():
    """Unconstrained subschemas and alternation patterns compile to regexes that match exactly the
    valid documents (outlines-core 0.2 alone accepts a bare string for both schemas below)."""
    from outlines_core.json_schema import build_regex_from_schema

    from continuum.guides import schema_to_regex

    cases = [
        ({"type": "object", "properties": {"a": {}, "t": {"title": "only an annotation"}}, "required": ["a", "t"],
          "additionalProperties": False},
         ['{"a": "x", "t": 1}', '{"a": [1, "z"], "t": null}', '{"a": {"k": true}, "t": "s"}'], ['"x"', '{"a": 1}']),
        ({"type": "object", "properties": {"v": {"type": "string", "pattern": "cat|dog"}}, "required": ["v"]},
         ['{"v": "cat"}', '{"v": "dog"}'], ['{"v": "cat}', '{"v": dog"}', '{"v": "cow"}']),
        ({"type": "object", "properties": {"v": {"type": "string", "pattern": "^[a-z]+\\$$"}}, "required": ["v"]},
         ['{"v": "ab$"}'], ['{"v": "ab"}']),
    ]
    for schema, valid, invalid in cases:
        regex, _ = schema_to_regex(schema)
        assert all(re.fullmatch(regex, doc) for doc in valid), (schema, regex)
        assert not any(re.fullmatch(regex, doc) for doc in invalid), (schema, regex)
    raw = build_regex_from_schema(json.dumps({"type": "object", "properties": {"a": {}}, "required": ["a"]}), r"[ ]?")
    assert re.fullmatch(raw, '"x"')  # the upstream bug the work-around exists for; drop it when this fails


def test_json_with_any_value_fields_validates(model):
    import jsonschema

    schema = {"type": "object", "properties": {"anything": {}, "code": {"type": "string", "pattern": "^(ab|cd)$"}},
              "required": ["anything", "code"], "additionalProperties": False}
    gen = continuous(generate.json(model, schema, samplers.multinomial(4)))
    complete = 0
    for seed in range(3):
        state = gen("data: ", max_tokens=60, rng=torch.Generator().manual_seed(seed))
        for i in range(state.samples):
            try:
                value = state[i, :].value
            except IncompleteGenerationError:
                continue
            jsonschema.validate(value, schema)
            complete += 1
    assert complete > 0


@pytest.mark.parametrize("keyword, schema", [
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 0}),
    ("minProperties", {"type": "object", "minProperties": 1}),
    ("contains", {"type": "array", "contains": {"type": "integer"}}),
    ("only the length", {"type": "string", "pattern": "[a-z]+", "maxLength": 4}),
    # a one-branch oneOf is now merged exactly by the normaliser; two branches stay an anyOf
    ("anyOf beside properties", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                 "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}),
])
def test_more_unenforced_schema_constructs_warn(model, keyword, schema):
    from continuum.guides import SchemaCoverageWarning

    with pytest.warns(SchemaCoverageWarning, match=keyword):
        generate.json(model, schema, backend="outlines")


def test_json_schema_as_string(model):
    schema = {"type": "object", "properties": {"x": {"enum": ["a", "b"]}, "y": {"type": "boolean"}}, "required": ["x", "y"],
              "additionalProperties": False}
    value = generate.json(model, json.dumps(schema), samplers.greedy())("x", max_tokens=40)
    assert isinstance(value, dict) and set(value) == {"x", "y"} and value["x"] in "ab"


def test_incomplete_constrained_output_raises_clear_error(model):
    gen = generate.regex(model, r"[a-z]{30}", samplers.greedy())
    with pytest.raises(IncompleteGenerationError, match="max_tokens=3") as info:
        gen(["a", "b"], max_tokens=3)
    assert info.value.rows == [0, 1]
    # the continuous generator returns the state; reading its value raises, its text is there
    state = continuous(gen)("a", max_tokens=3)
    assert len(state.last_text) > 0
    with pytest.raises(IncompleteGenerationError):
        state.value
    # a text generator can continue it
    more = continuous(generate.text(model, samplers.greedy()))(state, max_tokens=2)
    assert list(more)[0].startswith(list(state)[0])


def test_same_generator_resumes_an_unfinished_pattern(model):
    pattern = r"[0-9]{12}"
    gen = continuous(generate.regex(model, pattern, samplers.greedy()))
    part = gen(["Code: ", "N"], max_tokens=2)
    with pytest.raises(IncompleteGenerationError) as info:
        part.value
    assert info.value.rows == [0, 1]
    done = gen(part, max_tokens=30)
    for prompt, value, text in zip(["Code: ", "N"], done.value, done):
        assert re.fullmatch(pattern, value) and text == prompt + value
    # an edited state starts a fresh pattern instead
    fresh = gen(part + " ", max_tokens=30)
    assert all(re.fullmatch(pattern, v) for v in fresh.value)


def test_bad_generator_arguments(model):
    with pytest.raises(InvalidRegexError, match="regex"):
        generate.regex(model, "[a-")
    with pytest.raises(EmptyChoicesError, match="at least one"):
        generate.choice(model, [])
    with pytest.raises(EmptyChoicesError):
        generate.choice(model, "yes")
    with pytest.raises(UnsupportedSchemaError, match="not valid JSON"):
        generate.json(model, "{not json")
    with pytest.raises(UnsupportedSchemaError):
        generate.json(model, {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(UnsupportedSchemaError):
        generate.json(model, 42)
    assert all(issubclass(e, ValueError) for e in (InvalidRegexError, EmptyChoicesError, UnsupportedSchemaError))


def test_compiled_index_is_cached(model):
    class Fresh(BaseModel):
        a: int
        b: list[bool]
        c: str = Field(max_length=4)

    g1 = generate.json(model, Fresh, backend="outlines")
    g2 = generate.json(model, Fresh, backend="outlines")
    assert g1.guide is g2.guide  # the second generator reuses the compiled index (no timing: CI machines are noisy)
    assert generate.json(model, Fresh).guide is generate.json(model, Fresh, backend="llguidance").guide
    assert generate.json(model, Fresh).guide is not g1.guide


def test_pydantic_models_are_closed():
    """Pydantic drops extra keys (extra="ignore"), so they are not generated; extra="allow" keeps them."""
    import jsonschema
    from pydantic import ConfigDict

    from continuum.guides import prepare_json_schema

    class Inner(BaseModel):
        x: int

    class Open(BaseModel):
        model_config = ConfigDict(extra="allow")
        y: int

    class Outer(BaseModel):
        inner: Inner
        open: Open

    prepared = prepare_json_schema(Outer)
    accepts = jsonschema.Draft202012Validator(prepared.schema).is_valid  # what the engines are given
    assert accepts({"inner": {"x": 1}, "open": {"y": 2, "extra": 3}})
    assert not accepts({"inner": {"x": 1, "extra": 3}, "open": {"y": 2}})
    assert not accepts({"inner": {"x": 1}, "open": {"y": 2}, "extra": 3})
    assert prepared.parse('{"inner": {"x": 1}, "open": {"y": 2}}') == Outer(inner=Inner(x=1), open=Open(y=2))


def test_escape_for_outlines_regex():
    special = "a.b*c+d?(e)[f]{g}|h^i$j\\k#l&m-n~o p"
    pattern = escape(special)
    assert re.fullmatch(pattern, special)


def test_stories_choice_and_json(stories):
    """The real model follows constraints and picks plausible options."""
    c = generate.choice(stories, [" happy", " sad", " a dinosaur"], samplers.greedy())
    assert c("Lily was very") in (" happy", " sad", " a dinosaur")

    class Story(BaseModel):
        name: str = Field(max_length=10)
        mood: Color

    out = generate.json(stories, Story, samplers.greedy())("Once upon a time, a girl: ", max_tokens=40)
    assert isinstance(out, Story)


def test_exact_choice_scores_options_in_one_forward(model):
    """Exact choice = argmax of the options' total log-probs, computed in one forward pass."""
    from conftest import count_forward_tokens

    options = ["cat", " dog", "東京 🤗"]
    prompt = "The pet is a"
    gen = continuous(generate.choice(model, options, samplers.greedy()))
    base = continuous(generate.text(model, samplers.greedy()))(prompt, max_tokens=0)
    expected = []
    for o in options:
        s = base + o
        ids = s.token_ids
        with torch.no_grad():
            lp = torch.log_softmax(model.model(input_ids=ids).logits[0].float(), -1)
        n = len(model.tokenizer.encode_continuation(o))
        L = ids.shape[1]
        expected.append(sum(float(lp[c - 1, ids[0, c]]) for c in range(L - n, L)))
    counter, handle = count_forward_tokens(model)
    try:
        state = gen(base)
    finally:
        handle.remove()
    assert counter["calls"] == 1
    best = max(range(3), key=lambda i: expected[i])
    assert state.value == options[best]
    assert math.isclose(float(state.weights[0, 0]), expected[best], abs_tol=1e-4)
    assert list(state)[0] == prompt + options[best]


def test_choice_beam_search_returns_distinct_best_pairs(model):
    options = ["red", "green", "blue", "a"]
    gen = continuous(generate.choice(model, options, samplers.beam_search(3)))
    state = gen(["Color: ", "x"])
    for b, row in enumerate(state.value):
        assert len(set(row)) == 3 and set(row) <= set(options)
        w = state.weights[b].tolist()
        assert w == sorted(w, reverse=True)
    # the beams continue across turns, re-ranked on the whole sequence
    more = continuous(generate.choice(model, ["!", "?"], samplers.beam_search(3)))(state)
    assert more.shape == (2, 3)
    assert all(t.endswith(("!", "?")) for t in more)


def test_choice_methods(model):
    for method in ("exact", "mean", "greedy"):
        gen = generate.choice(model, ["yes", "no"], samplers.multinomial(4), method=method)
        out = gen("Q: ", rng=torch.Generator().manual_seed(0))
        assert set(out) <= {"yes", "no"}
    with pytest.raises(ValueError, match="method"):
        generate.choice(model, ["a"], method="best")
