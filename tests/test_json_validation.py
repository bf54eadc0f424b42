"""No silent invalid output: every JSON output of a dict schema is validated with jsonschema.

outlines-core does not enforce a ``pattern`` beside ``minLength``/``maxLength`` (only the length);
``{"minLength": 1, "maxLength": 2, "pattern": "^$"}`` is satisfiable by no string, so the engine
writes a 1-2 character string that the validator rejects, deterministically, whatever the model:
the generator must raise ``SchemaViolationError``.
"""

from __future__ import annotations

import warnings

import jsonschema
import pytest
import torch

from continuum import continuous, generate, samplers
from continuum.errors import SchemaViolationError

IMPOSSIBLE = {"type": "object", "properties": {"n": {"type": "string", "minLength": 1, "maxLength": 2, "pattern": "^$"}},
              "required": ["n"], "additionalProperties": False}


def _gen(model, schema, sampler, **kw):
    kw.setdefault("backend", "outlines")  # the engine that lets this through: post-validation must catch it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return generate.json(model, schema, sampler, **kw)


def test_llguidance_refuses_the_impossible_schema_at_creation(model):
    from continuum.errors import UnsupportedSchemaError

    with pytest.raises(UnsupportedSchemaError, match="unsatisfiable"):
        generate.json(model, IMPOSSIBLE, backend="llguidance")


def test_violation_raises_naming_row_path_and_rule(model):
    gen = _gen(model, IMPOSSIBLE, samplers.multinomial(2))
    with pytest.raises(SchemaViolationError) as info:
        gen(["a: ", "b: "], max_tokens=30, rng=torch.Generator().manual_seed(0))
    err = info.value
    assert (err.row, err.batch, err.sample) == (0, 0, 0) and "row 0 (batch 0, sample 0)" in str(err)
    assert err.path == "/n" and err.rule.split()[0] == "pattern" and "/properties/n/" in err.rule
    with pytest.raises(jsonschema.ValidationError):  # the reference agrees
        jsonschema.validate(err.value, IMPOSSIBLE)


def test_continuous_state_value_raises_and_the_state_stays_usable(model):
    gen = continuous(_gen(model, IMPOSSIBLE, samplers.greedy()))
    state = gen(["x: ", "y: "], max_tokens=30)
    with pytest.raises(SchemaViolationError) as info:
        state.value
    assert info.value.row == 0
    with pytest.raises(SchemaViolationError) as info:
        state[1, :].value  # each row names itself: batch 1 of the original is row 0 of the selection
    assert info.value.batch == 0
    assert '"n"' in state.last_text[0]  # the text is still there to inspect


def test_valid_outputs_pass_and_max_string_length_bounds_strings(model):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    gen = _gen(model, schema, samplers.multinomial(3), max_string_length=4)
    got = 0
    for seed in range(3):
        try:
            values = gen("User: ", max_tokens=40, rng=torch.Generator().manual_seed(seed))
        except SchemaViolationError as exc:  # outlines-core ignores `minimum`: refused, never returned
            assert exc.rule.startswith("minimum")
            continue
        except Exception as exc:  # noqa: BLE001 - incomplete rows are allowed, nothing else
            assert type(exc).__name__ == "IncompleteGenerationError", exc
            continue
        for v in values:
            jsonschema.validate(v, schema)
            assert len(v["name"]) <= 4
            got += 1
    assert got > 0


def test_a_repeated_schema_is_prepared_once(gpt2_model, monkeypatch):
    """A server's response format arrives with every request: its compiled guide is cached per tokenizer by schema
    and options (bounded), so the second ``generate.json`` of the same schema prepares nothing (the schema is not
    normalised again: counted) and gets the same guide; another schema is its own entry."""
    from continuum.guides import compile as compiled

    calls = []
    real = compiled.prepare_json_schema
    monkeypatch.setattr(compiled, "prepare_json_schema", lambda *a, **k: calls.append(1) or real(*a, **k))
    schema = {"type": "object", "properties": {"town": {"type": "string", "maxLength": 20},
                                               "code": {"type": "string", "pattern": "^[0-9]{5}$"}},
              "required": ["town", "code"], "title": "repeated"}
    first = generate.json(gpt2_model, schema)
    prepared = len(calls)
    assert prepared >= 1
    again = generate.json(gpt2_model, dict(reversed(list(schema.items()))))  # (the same schema, keys in another order)
    assert again.guide is first.guide and len(calls) == prepared
    before = len(compiled._JSON_CACHES[gpt2_model.tokenizer])
    other = generate.json(gpt2_model, {**schema, "required": ["town"]})
    assert other.guide is not first.guide and len(calls) > prepared
    assert len(compiled._JSON_CACHES[gpt2_model.tokenizer]) == min(before + 1, compiled._JSON_CACHE_SIZE)  # (bounded)
