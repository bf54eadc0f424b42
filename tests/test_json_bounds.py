"""JSON that ends: numbers the schema leaves unbounded are bounded (``bounds=``), and only those.

* termination, against a brute-force reference: an adversarial walk that always writes another
  digit when the guide allows one ends under the default bounds, and does not end without them;
  ``generate.json`` on the random tiny models and on stories260K returns a value that ``jsonschema``
  accepts, within the context;
* soundness: every value the bounded schema accepts, the original accepts (``jsonschema`` on a grid
  of values around the bounds), and a bound the schema sets is kept: a value above the default digit
  limit but inside the schema's ``maximum`` walks through the compiled guide;
* bad ``bounds`` values are a ``GeneratorArgumentError`` at creation.
"""

from __future__ import annotations

import json
import re
import warnings

import jsonschema
import pytest
import torch
from test_strict_json import _walk  # (guide, text, tokenizer): does the guide accept the text, token by token

from continuum import generate, samplers
from continuum.errors import GeneratorArgumentError, UnsupportedSchemaError
from continuum.guides import JsonBounds, SchemaCoverageWarning
from continuum.guides.compile import json_for
from continuum.guides.normalize import normalize_schema

NUMBERS = {"type": "object", "properties": {
    "count": {"type": "integer"},
    "ratio": {"type": "number"},
    "reading": {"type": "number", "minimum": 0},
    "readings": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
    "required": ["count", "ratio", "reading", "readings"]}


def _digit_hungry_walk(guide, tokenizer, limit: int) -> tuple[str, bool]:
    """(text, ended): always take the allowed token with the most digits (then one with ``.``, ``e``
    or ``-``, which open more digits), else the lowest allowed id; ends when only EOS is left."""
    size = len(tokenizer.hf)
    pieces = [tokenizer.hf.decode([i]) for i in range(size)]
    eos = tokenizer.eos_token_ids
    state, text = guide.new_state(), ""
    for _ in range(limit):
        allowed = torch.isfinite(guide.apply_mask(torch.zeros(1, size), [state])[0]).nonzero().flatten().tolist()
        allowed = [t for t in allowed if t not in eos]
        if not allowed:
            return text, True
        digits = sorted(allowed, key=lambda t: (-sum(c.isdigit() for c in pieces[t]), t))
        opening = [t for t in allowed if any(c in pieces[t] for c in ".eE-")]
        pick = digits[0] if any(c.isdigit() for c in pieces[digits[0]]) else (opening or allowed)[0]
        state = guide.advance(state, pick)
        assert state is not None
        text += pieces[pick]
    return text, False


# --- termination ------------------------------------------------------------------------------

def test_default_bounds_end_a_digit_hungry_walk_and_no_bounds_do_not(gpt2_model):
    tok = gpt2_model.tokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bounded, _ = json_for(tok, NUMBERS)
        free, _ = json_for(tok, NUMBERS, bounds=None)
    text, ended = _digit_hungry_walk(bounded, tok, 400)
    assert ended, text[-200:]
    value = json.loads(text)
    jsonschema.validate(value, NUMBERS)
    # every number within the default bounds: integer parts of 18 digits (llguidance reads the range
    # through a float, so 10**18 itself may be written), fractions of <= 10 digits, no exponent
    numbers = re.findall(r"-?([0-9]+)(?:\.([0-9]+))?([eE][-+]?[0-9]+)?", text)
    assert len(numbers) == 3 + len(value["readings"]), text
    for whole, fraction, exponent in numbers:
        assert int(whole) <= 10 ** 18 and len(fraction) <= 10 and not exponent, text
    text, ended = _digit_hungry_walk(free, tok, 400)
    assert not ended, "without bounds the walk should still be writing digits"


NUMBER_HEAVY_PROMPT = "Measurements as JSON: "


@pytest.mark.parametrize("bounds", ["default", "small"])
def test_number_heavy_schema_ends_on_the_random_models(model, bounds):
    gen = generate.json(model, NUMBERS, samplers.multinomial(), bounds=bounds)
    room = 200  # the tiny models have 256 positions
    for seed in range(3):
        value = gen(NUMBER_HEAVY_PROMPT, max_tokens=room, rng=torch.Generator().manual_seed(seed))
        jsonschema.validate(value, NUMBERS)


def test_number_heavy_schema_ends_on_stories260k(stories):
    room = stories.context_length - len(stories.tokenizer.encode_continuation(NUMBER_HEAVY_PROMPT)) - 1
    for bounds in ("default", "small"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SchemaCoverageWarning)
            gen = generate.json(stories, NUMBERS, samplers.greedy(), bounds=bounds)
        jsonschema.validate(gen(NUMBER_HEAVY_PROMPT, max_tokens=room), NUMBERS)


# --- soundness, and the schema's own bounds ---------------------------------------------------

GRID = [0, 1, -1, 7.5, -0.25, 10 ** 9 - 1, 10 ** 9, -(10 ** 9), 10 ** 17, 10 ** 18 - 1, 10 ** 18, -(10 ** 18),
        5 * 10 ** 18, 10 ** 25, 1e30, 2e30, 0.1234, 0.12345, 1.5e-11, 3.0, None, "x"]


@pytest.mark.parametrize("bounds", [JsonBounds(), JsonBounds(integer_digits=9, fraction_digits=4)])
@pytest.mark.parametrize("schema", [
    {"type": "integer"}, {"type": "number"}, {"type": ["number", "null"]}, {"type": "integer", "minimum": 0},
    {"type": "integer", "maximum": 1e30}, {"type": "number", "minimum": 2e30}, {"type": "number", "multipleOf": 0.5},
    {"type": "integer", "allOf": [{"maximum": 5 * 10 ** 18}]}, {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    {"type": "array", "items": {"type": "number", "exclusiveMaximum": 10 ** 25}},
])
def test_bounded_schema_accepts_only_valid_values_and_keeps_the_schemas_bounds(schema, bounds):
    original = jsonschema.Draft202012Validator(schema)
    bounded = jsonschema.Draft202012Validator(normalize_schema(schema, bounds=bounds).schema)
    for value in GRID + [[v] for v in GRID]:
        if bounded.is_valid(value):
            assert original.is_valid(value), (schema, value)
    for key in ("minimum", "maximum", "multipleOf", "exclusiveMaximum"):  # never tightened, never dropped
        if key in schema:
            assert normalize_schema(schema, bounds=bounds).schema[key] == schema[key]
    # the schema's own large bound still admits what lies beyond the default digit limit
    if schema.get("maximum") == 1e30:
        assert bounded.is_valid(10 ** 25)
    if schema.get("minimum") == 2e30:
        assert bounded.is_valid(3e30)


def test_a_schemas_own_large_bound_is_producible(gpt2_model):
    """A value above the default digit limit (18) but inside the schema's ``maximum`` walks through
    the compiled guide (llguidance and outlines-core), and the other side is still bounded."""
    tok = gpt2_model.tokenizer
    schema = {"type": "object", "properties": {"big": {"type": "integer", "maximum": 9 * 10 ** 18},
                                               "far": {"type": "number", "maximum": 9e18}},
              "required": ["big", "far"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guide, prepared = json_for(tok, schema)
        outlines, _ = json_for(tok, {"type": "integer", "maximum": 1e30}, backend="outlines")
    assert prepared.schema["properties"]["big"]["maximum"] == 9 * 10 ** 18
    assert _walk(guide, '{"big":5000000000000000000,"far":5000000000000000000.5}', tok)
    assert not _walk(guide, '{"big":-5000000000000000000,"far":1}', tok)  # below the default lower bound
    assert _walk(outlines, str(10 ** 25), tok)  # 26 digits under a maximum of 1e30 (31 digits)
    assert not _walk(outlines, "-" + str(10 ** 40), tok)
    small, _ = json_for(tok, {"type": "integer", "minimum": -(10 ** 12)}, bounds="small")
    assert _walk(small, str(-(10 ** 12)), tok) and _walk(small, "999999999", tok)
    assert not _walk(small, "1000000000", tok)


def test_non_default_bounds_are_named_in_the_coverage_warning(gpt2_model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate.json(gpt2_model, NUMBERS)
    assert not [w for w in caught if issubclass(w.category, SchemaCoverageWarning)]
    with pytest.warns(SchemaCoverageWarning, match=r"integer part <= 9 digits.*fraction <= 4 digits"):
        gen = generate.json(gpt2_model, NUMBERS, bounds="small")
    assert gen.exact  # a bound narrows: nothing goes unenforced


# --- bad values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [dict(integer_digits=-1), dict(integer_digits=0), dict(integer_digits=2.5),
                                 dict(integer_digits=True), dict(integer_digits=19), dict(fraction_digits=-1),
                                 dict(fraction_digits=11), dict(fraction_digits="4"), dict(max_items=0),
                                 dict(max_properties=-3), dict(max_string_length=1.5)])
def test_bad_bound_values_raise(bad):
    with pytest.raises(GeneratorArgumentError, match=next(iter(bad))):
        JsonBounds(**bad)


def test_bad_bounds_arguments_raise_at_creation(gpt2_model):
    from continuum.processors import JSONLogitsProcessor

    for bad in ("tiny", 5, {"integer_digits": 3}, ["small"]):
        with pytest.raises(GeneratorArgumentError, match="bounds must be one of"):
            generate.json(gpt2_model, NUMBERS, bounds=bad)
        with pytest.raises(GeneratorArgumentError, match="bounds must be one of"):
            JSONLogitsProcessor(NUMBERS, gpt2_model.tokenizer.hf, bounds=bad)
    with pytest.raises(UnsupportedSchemaError, match="max_items"):
        generate.json(gpt2_model, NUMBERS, max_items=-1, bounds="small")


def test_processor_takes_bounds(gpt2_model):
    from continuum.processors import JSONLogitsProcessor

    tok = gpt2_model.tokenizer
    text = '{"count":1234567890,"ratio":1,"reading":1,"readings":[]}'  # 10 integer digits
    assert _walk(JSONLogitsProcessor(NUMBERS, tok.hf).guide, text, tok)
    with pytest.warns(SchemaCoverageWarning):
        small = JSONLogitsProcessor(NUMBERS, tok.hf, bounds="small")
    assert not _walk(small.guide, text, tok)


# --- the value as a whole (bounds="small": JsonBounds.whole_value) -------------------------------

# BFCL_sql's shape: arrays of arrays of strings (8 x 8 x 32 characters under per-leaf bounds)
TABLE = {"type": "object", "properties": {
    "table": {"type": "string"},
    "columns": {"type": "array", "items": {"type": "string"}},
    "rows": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
    "conditions": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}}},
    "required": ["table", "columns", "rows", "conditions"], "additionalProperties": False}
# MCPspec's shape: extra keys beside an optional declared property, an untyped value, an open pattern
OPEN = {"type": "object", "properties": {
    "method": {"const": "ping"},
    "params": {"type": "object", "additionalProperties": {}, "properties": {"_meta": {"type": "object"}}},
    "extra": {},
    "version": {"type": "string", "pattern": "[0-9]+\\.[0-9]+"},
    "labels": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}}}},
    "required": ["method", "params", "extra", "version", "labels"]}
WHOLE_PROMPT = "Once upon a time, JSON: "


def _normalized(schema, bounds="small"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SchemaCoverageWarning)
        return normalize_schema(schema, bounds=bounds).schema


def test_small_bounds_shrink_inside_arrays_and_maps_and_default_does_not():
    props = _normalized(TABLE)["properties"]
    assert props["table"]["maxLength"] == 32 and props["columns"]["maxItems"] == 8
    assert props["columns"]["items"]["maxLength"] == 8  # 32 // 8 items around it, at least 8 characters
    assert props["rows"]["maxItems"] == 8 and props["rows"]["items"]["maxItems"] == 1  # 8 // 8
    assert props["rows"]["items"]["items"]["maxLength"] == 8
    labels = _normalized(OPEN)["properties"]["labels"]  # a map's values are repeated like items
    assert labels["maxProperties"] == 8 and labels["additionalProperties"]["maxItems"] == 1
    nested_map = {"type": "object", "additionalProperties": {"type": "object", "properties": {
        "config": {"type": "object", "additionalProperties": {"type": "string"}}}, "required": ["config"]}}
    config = _normalized(nested_map)["additionalProperties"]["properties"]["config"]  # a map inside a map of 8
    assert config["maxProperties"] == 1 and config["additionalProperties"] is False
    assert config["patternProperties"] == {"^.{0,8}$": {"type": "string", "maxLength": 8}}  # keys as short as strings
    # per leaf only without whole_value (the same sizes, not divided); nothing at all by default
    per_leaf = _normalized(TABLE, JsonBounds(32, 8, 9, 4, 8))["properties"]
    assert per_leaf["rows"]["items"]["maxItems"] == 8 and per_leaf["rows"]["items"]["items"]["maxLength"] == 32
    assert _normalized(TABLE, "default")["properties"]["rows"] == TABLE["properties"]["rows"]
    assert _normalized(OPEN, "default")["properties"]["params"]["additionalProperties"] == {}


def test_small_bounds_close_open_objects_with_optional_properties_and_bound_open_values():
    props = _normalized(OPEN)["properties"]
    assert props["params"]["additionalProperties"] is False  # its keys could not be counted
    assert set(props["params"]["properties"]) == {"_meta"}
    assert props["extra"]["type"] == ["null", "boolean", "integer", "number", "string"]  # any value: a scalar
    assert props["extra"]["maxLength"] == 32 and props["extra"]["exclusiveMaximum"] == 10 ** 9
    assert props["version"]["pattern"].startswith("^") and props["version"]["pattern"].endswith("$")
    assert re.fullmatch(props["version"]["pattern"], "v1.2 (beta)") and not re.fullmatch(props["version"]["pattern"],
                                                                                         "1" * 100)


@pytest.mark.parametrize("schema", [
    TABLE, OPEN,
    {"type": "array", "items": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {}, "maxProperties": 3},
    {"type": "object", "properties": {"a": {}}, "patternProperties": {"^a": {"type": "integer"}}},
    {"type": "string", "pattern": "^[a-z]{2,3}$"}, {"type": "array"}, {"format": "date-time"},
])
def test_small_bounds_narrow_soundly_and_keep_the_schemas_own_bounds(schema):
    original = jsonschema.Draft202012Validator(schema)
    bounded_schema = _normalized(schema)
    bounded = jsonschema.Draft202012Validator(bounded_schema)
    values = [None, True, 3, 2.5, 10 ** 12, "", "ab", "1.5", "x" * 40, [], ["ab"], [["ab"]], [["x" * 30] * 6] * 2,
              [1.5, "a", None], {}, {"a": 1}, {"a": 1, "b": 2}, {"b": [1]}, {"aa": "1"},
              {"table": "t", "columns": ["c"], "rows": [["1"]], "conditions": []},
              {"method": "ping", "params": {}, "extra": 1, "version": "1.2", "labels": {"k": ["v"]}},
              {"method": "ping", "params": {"x": 1}, "extra": [1], "version": "1.2", "labels": {}}]
    for value in values:
        if bounded.is_valid(value):
            assert original.is_valid(value), (schema, value)
    if "maxProperties" in schema:  # a count the schema sets: kept, the object left open
        assert bounded_schema["maxProperties"] == 3 and bounded_schema["additionalProperties"] != False  # noqa: E712
    if schema.get("patternProperties"):  # a key pattern that matches a declared property: left open
        assert "patternProperties" in bounded_schema
    inner = schema.get("items", {}).get("items", {})
    if inner.get("maxLength") == 20:  # own bounds inside arrays are never divided
        assert bounded_schema["items"]["maxItems"] == 5 and bounded_schema["items"]["items"]["maxLength"] == 20
    if schema.get("pattern") == "^[a-z]{2,3}$":  # a pattern that bounds the length itself: unchanged
        assert bounded_schema["pattern"] == schema["pattern"]


def test_small_bounds_are_enforced_by_the_guide_and_named_in_the_warning(gpt2_model):
    tok = gpt2_model.tokenizer
    with pytest.warns(SchemaCoverageWarning, match=r"inside arrays.*optional properties|optional properties"):
        guide, _ = json_for(tok, OPEN, bounds="small")
    labels = '"labels":{"k":["v"]}'
    assert _walk(guide, '{"method":"ping","params":{"_meta":{}},"extra":1,"version":"1.2",' + labels + '}', tok)
    assert not _walk(guide, '{"method":"ping","params":{"x":1},"extra":1,"version":"1.2",' + labels + '}', tok)
    assert not _walk(guide, '{"method":"ping","params":{},"extra":[1],"version":"1.2",' + labels + '}', tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default, _ = json_for(tok, OPEN, bounds="default")
    assert _walk(default, '{"method":"ping","params":{"x":1},"extra":[1],"version":"1.2",' + labels + '}', tok)
    # MCPspec's ServerResult: alternatives beside one with extra keys; closed, none of them writes a new key
    results = {"anyOf": [{"type": "object", "additionalProperties": {}, "properties": {"_meta": {"type": "object"}}},
                         {"type": "object", "properties": {"tools": {"type": "array"}}, "required": ["tools"]}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        closed, _ = json_for(tok, results, bounds="small")
        opened, _ = json_for(tok, results, bounds="default")
    assert _walk(closed, '{"tools":[]}', tok) and not _walk(closed, '{"tools":[],"zzz":1}', tok)
    assert _walk(opened, '{"tools":[],"zzz":1}', tok)
    with pytest.warns(SchemaCoverageWarning, match="inside arrays"):
        table, _ = json_for(tok, TABLE, bounds="small")
    assert _walk(table, '{"table":"t","columns":["abcdefgh"],"rows":[["x"]],"conditions":[]}', tok)
    assert not _walk(table, '{"table":"t","columns":["abcdefghi"],"rows":[],"conditions":[]}', tok)
    assert not _walk(table, '{"table":"t","columns":[],"rows":[["x","y"]],"conditions":[]}', tok)


def test_nested_and_open_schemas_end_on_the_random_models(model):
    for schema in (TABLE, OPEN):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SchemaCoverageWarning)
            gen = generate.json(model, schema, samplers.multinomial(), bounds="small")
        room = model.context_length - len(model.tokenizer.encode_continuation(WHOLE_PROMPT)) - 1  # 256 positions
        for seed in range(2):
            value = gen(WHOLE_PROMPT, max_tokens=room, rng=torch.Generator().manual_seed(seed))
            jsonschema.validate(value, schema)


def test_nested_and_open_schemas_end_on_stories260k(stories):
    """Greedy stories260K filled its 512-token context on both shapes with per-leaf bounds (issue 32)."""
    from continuum.errors import IncompleteGenerationError

    room = stories.context_length - len(stories.tokenizer.encode_continuation(WHOLE_PROMPT)) - 1
    for schema in (TABLE, OPEN):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SchemaCoverageWarning)
            gen = generate.json(stories, schema, samplers.greedy(), bounds="small")
            per_leaf = generate.json(stories, schema, samplers.greedy(), bounds=JsonBounds(32, 8, 9, 4, 8))
        jsonschema.validate(gen(WHOLE_PROMPT, max_tokens=room), schema)
        with pytest.raises(IncompleteGenerationError):
            per_leaf(WHOLE_PROMPT, max_tokens=room)


@pytest.mark.parametrize("pattern, every", [(".*", True), ("^.*$", True), ("(.*)", True), ("", True), ("^", True),
                                            ("^$", False), ("^a?$", False), ("^.{0,8}$", False), ("a*", False)])
def test_a_key_pattern_becomes_a_plain_bounded_key_only_when_it_matches_every_key(pattern, every):
    from continuum.guides.closing import bounded_key_pattern

    bounded = bounded_key_pattern(pattern, 32)
    assert (bounded == "^.{0,32}$") == every
    for key in ("", "a", "zzz", "x" * 8, "x" * 9, "abc def"):  # a narrowing: every key it allows, the pattern allows
        if re.search(bounded, key):
            assert re.search(pattern, key), (pattern, key)


def test_small_bounds_fall_back_to_per_leaf_bounds_when_they_leave_nothing(gpt2_model, monkeypatch):
    """A map's arrays divided to 1 item, while another allOf member asks the same key for 2 (Handwritten
    ``pp3``): the whole-value form is unsatisfiable, so the schema compiles with per-leaf bounds."""
    import continuum.guides.compile as compile_module

    tok = gpt2_model.tokenizer
    schema = {"type": "object", "required": ["abc"], "allOf": [
        {"additionalProperties": {"type": "array", "minItems": 2}},
        {"patternProperties": {"c": {"type": "array", "items": {"type": "integer"}}}}]}
    tried, ladder = [], compile_module._llguidance_json
    monkeypatch.setattr(compile_module, "_llguidance_json",
                        lambda *args: tried.append(args[5]["bounds"].whole_value) or ladder(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SchemaCoverageWarning)
        guide, prepared = json_for(tok, schema, bounds="small")
    assert tried == [True, False] and prepared.exact
    assert _walk(guide, '{"abc":[1,2]}', tok)
