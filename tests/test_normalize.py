"""The JSON Schema normaliser: exact rewrites stay exact, narrowings stay sound, refusals name the keyword.

Soundness is checked against ``jsonschema`` (the reference): every instance the normalised schema
accepts must be valid under the original, on handwritten instances and on the invalid examples of
the JSONSchemaBench sample (a slice here; the full sweep is ``benchmarks/jsonschema_bench.py``).
"""

from __future__ import annotations

import json
import warnings

import pytest

from continuum.errors import SchemaViolationError, UnsupportedSchemaError
from continuum.guides import SchemaCoverageWarning, normalize_schema, prepare_json_schema
from continuum.guides.prepare import normalized_validator, original_validator

from conftest import FIXTURES

# A pool of instances to compare the original and normalised schemas on (brute force).
_SCALARS = [None, True, False, 0, 1, 2, 3, 7, -1, 2.5, "", "a", "b", "ab", "abc", "2024-01-01"]
_OBJECTS = [{}, {"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {"a": "x"}, {"kind": "cat"}, {"kind": "dog"},
            {"kind": "cat", "lives": 9}, {"kind": "dog", "lives": 9}, {"a": 1, "b": 2, "c": 3}, {"c": 1},
            {"kind": "cat", "a": 1}, {"x": {"a": 1}}, {"x": {}}]
_ARRAYS = [[], [1], [1, 1], [1, 2], ["a"], ["a", "a"], ["a", "b"], [1, "a"], ["b", "a", "c"], [[]], [{}]]
POOL = _SCALARS + _OBJECTS + _ARRAYS


def _check(schema, exact: bool):
    norm = normalize_schema(schema)
    orig, new = original_validator(schema, norm.dialect), normalized_validator(norm)
    kept = 0
    for inst in POOL:
        ok_orig, ok_new = orig.is_valid(inst), new.is_valid(inst)
        assert not (ok_new and not ok_orig), f"unsound: {inst!r} accepted by {norm.schema} but not by {schema}"
        if exact:
            assert ok_new == ok_orig, f"not exact on {inst!r}: {norm.schema}"
        kept += ok_new
    assert exact == (not norm.narrowed), norm.narrowed
    return norm, kept


EXACT = [
    {"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer", "minimum": 1}}},
    {"type": "object", "properties": {"x": {"$ref": "#/definitions/o"}}, "definitions": {"o": {"required": ["a"]}}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"]}},
    {"dependencies": {"a": {"required": ["b"]}}},  # no $schema, draft-7 spelling
    {"dependentRequired": {"a": ["b", "c"]}},
    {"dependentSchemas": {"kind": {"properties": {"lives": {"type": "integer"}}, "required": ["lives"]}}},
    {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
               {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]}]},
    {"oneOf": [{"type": "number", "minimum": 2}, {"type": "number", "maximum": 1}]},  # via negation
    {"oneOf": [{"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]},  # negation
    {"not": {"type": "string"}},
    {"not": {"required": ["a"]}},
    {"not": {"properties": {"a": {"type": "string"}}}},
    {"not": {"type": "number"}},
    {"not": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]}},
    {"not": {}},
    {"if": {"required": ["kind"]}, "then": {"required": ["lives"]}, "else": {"required": ["a"]}},
    {"if": {"type": "string"}, "then": {"minLength": 2}},
    {"type": "array", "uniqueItems": True, "maxItems": 1},
    {"type": "array", "items": [{"type": "integer"}], "additionalItems": False},
    {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 2, "exclusiveMinimum": True},
    {"type": "string", "format": "not-a-known-format"},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "x-vendor": {"anything": 1}, "title": "t"},
]

NARROWED = [
    {"type": "array", "uniqueItems": True},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
    {"type": "array", "contains": {"type": "string"}},
    {"oneOf": [{"type": "object", "required": ["a"], "properties": {"a": {"const": 1}}},
               {"type": "object", "required": ["b"], "properties": {"b": {"enum": [1, 2]}}}]},
    {"if": {"properties": {"kind": {"const": "cat"}}}, "then": {"required": ["lives"]}, "else": {"required": ["a"]}},
]


@pytest.mark.parametrize("schema", EXACT, ids=lambda s: json.dumps(s)[:60])
def test_exact_rewrites_accept_exactly_the_same_instances(schema):
    _check(schema, exact=True)


@pytest.mark.parametrize("schema", NARROWED, ids=lambda s: json.dumps(s)[:60])
def test_narrowings_are_sound_and_keep_some_values(schema):
    norm, kept = _check(schema, exact=False)
    assert kept > 0  # narrowed, not emptied
    with pytest.warns(SchemaCoverageWarning, match=norm.narrowed[0].keyword):
        prepare_json_schema(schema)


@pytest.mark.parametrize("schema, path", [
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True, "minItems": 2}}},
     "/properties/tags/uniqueItems"),
    ({"properties": {"n": {"not": {"multipleOf": 3}}}}, "/properties/n/not"),
    ({"oneOf": [{"minimum": 1}, {"multipleOf": 2}]}, "/oneOf"),
    ({"type": "object", "propertyNames": {"pattern": "^a", "maxLength": 3}}, "/propertyNames"),
    ({"$ref": "https://example.com/s.json"}, "/$ref"),
    ({"$ref": "#/$defs/missing"}, "/$ref"),
])
def test_unenforceable_keywords_are_refused_with_their_path(schema, path):
    with pytest.raises(UnsupportedSchemaError) as info:
        normalize_schema(schema)
    assert info.value.path == path and path in str(info.value)
    assert info.value.keyword == path.rsplit("/", 1)[1]


def test_recursive_refs_stay_references():
    schema = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
              "$ref": "#/$defs/node"}
    norm = normalize_schema(schema)
    assert "$defs" in norm.schema and "$ref" in json.dumps(norm.schema)
    v = normalized_validator(norm)
    assert v.is_valid({"next": {"next": {}}}) and not v.is_valid({"next": {"next": 1}})


def test_formats_kept_only_where_an_engine_enforces_them():
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                               "c": {"type": "string", "format": "color"}}}
    props = normalize_schema(schema).schema["properties"]
    assert props["d"] == {"type": "string", "format": "date"} and props["c"] == {"type": "string"}


def test_max_string_length_bounds_only_unbounded_plain_strings():
    schema = {"type": "object", "properties": {
        "s": {"type": "string"}, "m": {"type": "string", "maxLength": 40}, "long": {"type": "string", "minLength": 30},
        "e": {"type": "string", "enum": ["x" * 50]}, "n": {"type": ["string", "null"]}}}
    props = normalize_schema(schema, max_string_length=16).schema["properties"]
    assert props["s"]["maxLength"] == 16 and props["m"]["maxLength"] == 40 and props["long"]["maxLength"] == 30
    assert "maxLength" not in props["e"] and props["n"]["maxLength"] == 16
    assert "maxLength" not in json.dumps(normalize_schema(schema).schema["properties"]["s"])
    with pytest.raises(UnsupportedSchemaError):
        normalize_schema(schema, max_string_length=0)


def test_parse_validates_against_the_original_schema_with_its_draft():
    prepared = prepare_json_schema({"$schema": "http://json-schema.org/draft-04/schema#",
                                    "type": "object", "properties": {"n": {"type": "integer"}}})
    assert prepared.parse('{"n": 3}') == {"n": 3}
    with pytest.raises(SchemaViolationError) as info:
        prepared.parse('{"n": 3.0}')  # an integer in 2020-12, not in draft 4
    assert info.value.path == "/n" and info.value.rule.startswith("type at /properties/n/type")
    with pytest.raises(SchemaViolationError):
        prepared.parse('{"n": ')


SCHEMAS = FIXTURES / "jsonschemas"
EVERY = 7


def _sample():
    if not SCHEMAS.exists():
        return []
    return [json.loads(line) for path in sorted(SCHEMAS.glob("*.jsonl"))
            for line in path.read_text().split("\n")[::EVERY] if line.strip()]  # not splitlines: keys hold U+2029


@pytest.mark.skipif(not SCHEMAS.exists(), reason="../shared/fixtures/jsonschemas is absent")
def test_sample_normalisation_is_sound_on_the_invalid_examples():
    """No invalid example of the sample becomes valid; most valid examples stay valid."""
    counts = {"schemas": 0, "normalised": 0, "invalid": 0, "valid": 0, "valid_kept": 0}
    for rec in _sample():
        counts["schemas"] += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                norm = normalize_schema(rec["schema"])
                orig = original_validator(rec["schema"], norm.dialect)
            except UnsupportedSchemaError:
                continue
        counts["normalised"] += 1
        new = normalized_validator(norm)
        for inst in rec["invalid_examples"]:
            if not orig.is_valid(inst):
                counts["invalid"] += 1
                assert not new.is_valid(inst), f"{rec['id']}: the invalid example {inst!r} became valid"
        for inst in rec["valid_examples"]:
            if orig.is_valid(inst):
                counts["valid"] += 1
                counts["valid_kept"] += new.is_valid(inst)
    assert counts["normalised"] >= 0.85 * counts["schemas"], counts
    assert counts["invalid"] > 100 and counts["valid_kept"] >= 0.95 * counts["valid"], counts
