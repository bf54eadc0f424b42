"""JSON Schema in front of the engines: preparing a schema so outlines-core compiles it soundly.

outlines-core turns a schema into a regex (``build_regex_from_schema``); this module works around
its known gaps and warns (:class:`SchemaCoverageWarning`) about keywords it does not enforce.
"""

from __future__ import annotations

import json as _json
import warnings
from typing import Any

from ..errors import UnsupportedSchemaError
from .bounds import MARKER

__all__ = ["outlines_regex", "outlines_regex_ignored", "SchemaCoverageWarning"]

# Keywords outlines-core 0.2 accepts but does not enforce in the regex (checked against 0.2.14;
# upstream issues dottxt-ai/outlines-core#147 and #261).
_UNENFORCED = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
               "patternProperties", "contains", "minProperties", "maxProperties", "dependentRequired"}
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
                "$schema", "$id", "id"}
# "Any JSON value", spelled so outlines-core groups it (see _prepare_schema).
_ANY_VALUE = {"anyOf": [{"type": t} for t in ("string", "number", "boolean", "null", "array", "object")]}
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "propertyNames")



class SchemaCoverageWarning(UserWarning):
    """The schema is not enforced exactly as written: keywords the engine does not enforce (dropped
    or widened: outputs that violate them raise ``SchemaViolationError``, never returned), or
    narrowings (every output is valid, some valid values cannot be generated). One per generator."""


def _group_pattern(pattern: str) -> str:
    """``pattern`` without its ``^``/``$`` anchors, in a group: outlines-core pastes it between two
    quotes as is, so a top-level ``a|b`` would bind across them (outlines-core#267)."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$"):
        body = pattern[:-1]
        if (len(body) - len(body.rstrip("\\"))) % 2 == 0:  # an even run of backslashes: `$` is an anchor
            pattern = body
    return "(" + pattern + ")"


def _prepare_schema(node: Any, ignored: set[str]) -> Any:
    """A copy of schema ``node`` that outlines-core 0.2 compiles correctly; collects in ``ignored``
    what it will not enforce.

    Work-arounds: a schema without constraints (``{}``, ``true``, annotations only) compiles to an
    ungrouped alternation that lets the whole document be a bare value (outlines-core#151), so it
    becomes an explicit ``anyOf`` of every type; ``pattern`` gets grouped (see ``_group_pattern``).
    """
    if node is True:
        return dict(_ANY_VALUE)
    if not isinstance(node, dict):
        return node
    if set(node) <= _ANNOTATIONS:
        return {**node, **_ANY_VALUE}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _prepare_schema(v, ignored) for k, v in value.items()}
        elif (key in _SCHEMA_LISTS or key in _SCHEMA_ONE) and isinstance(value, list):  # also draft-4 tuple `items`
            out[key] = [_prepare_schema(v, ignored) for v in value]
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            out[key] = _prepare_schema(value, ignored)
        elif key == "pattern" and isinstance(value, str):
            out[key] = _group_pattern(value)
        else:
            out[key] = value
        if key in _UNENFORCED:
            ignored.add(key)
    if "pattern" in node and ("minLength" in node or "maxLength" in node):
        ignored.add("pattern together with minLength/maxLength (only the length is enforced)")
    combinators = [k for k in ("allOf", "anyOf", "oneOf") if k in node]
    others = set(node) - _ANNOTATIONS - {"allOf", "anyOf", "oneOf", "$defs", "definitions"}
    if combinators and others:  # outlines-core reads either the combinator or the siblings, not both
        what = "properties" if "properties" in others else "other keywords"
        ignored.update(f"{k} beside {what}" for k in combinators)
    return out

# Formats outlines-core 0.2.14 turns into a regex; it refuses the others. Unasserted formats are
# annotations, so dropping one only widens toward what the original schema allows.
_OUTLINES_FORMATS = {"date-time", "date", "time", "uuid", "email", "uri"}


def _for_outlines(node: Any) -> Any:
    """Spell a normalised schema the way outlines-core 0.2 reads it: formats it lacks dropped, and
    ``false`` property schemas (forbidden names) removed, as it only writes the listed properties."""
    if isinstance(node, list):
        return [_for_outlines(v) for v in node]
    if not isinstance(node, dict):
        return node
    if MARKER in node:
        node = _outlines_digits(node)
    if ("enum" in node or "const" in node) and len(node) > 1 and "$ref" not in _json.dumps(node):
        # outlines-core reads enum/const OR the other keywords: keep the values the others allow (exact)
        import jsonschema

        values = [node["const"]] if "const" in node else node["enum"]
        rest = jsonschema.Draft202012Validator({k: v for k, v in node.items() if k not in ("enum", "const")})
        return {"enum": [v for v in values if rest.is_valid(v)]}
    out = {}
    for key, value in node.items():
        if key == "format" and value not in _OUTLINES_FORMATS:
            continue
        if key == "properties" and isinstance(value, dict):
            out[key] = {k: _for_outlines(v) for k, v in value.items() if v is not False}
        elif key in ("enum", "const"):
            out[key] = value
        else:
            out[key] = _for_outlines(value)
    return out


def _outlines_digits(node: dict) -> dict:
    """A node :func:`~continuum.guides.bounds.bound_numbers` bounded, spelled for outlines-core, which
    ignores ranges and ``multipleOf``: an integer's added range becomes ``maxDigits`` (exact for
    -/+ 10**k; as many as the schema's own bound on the other side needs, as digits bound both). Its
    number digit keywords are wrong in 0.2.14 (``maxDigitsInteger`` forbids one-digit integer parts,
    an empty exponent is allowed), so numbers stay unbounded there: a bound is a narrowing, dropping
    it only widens back to the schema."""
    added = node[MARKER]
    out = {k: v for k, v in node.items() if k != MARKER and k not in added}
    t = node.get("type")
    if "number" not in (t if isinstance(t, list) else [t]):
        digits = [len(str(abs(int(node[k])))) - (k in added) for k in ("exclusiveMinimum", "exclusiveMaximum",
                                                                      "minimum", "maximum") if k in node]
        if digits and all(isinstance(node[k], (int, float)) for k in ("exclusiveMinimum", "exclusiveMaximum",
                                                                       "minimum", "maximum") if k in node):
            out["maxDigits"] = max(digits)
    return out


def outlines_regex_ignored(schema: Any, whitespace_pattern: str | None = r"[ ]?") -> tuple[str, set[str]]:
    """(regex, keywords outlines-core will not enforce) of a NORMALISED schema; no warning."""
    from outlines_core.json_schema import build_regex_from_schema

    ignored: set[str] = set()
    prepared = _prepare_schema(_for_outlines(schema), ignored)
    try:
        regex = build_regex_from_schema(_json.dumps(prepared), whitespace_pattern)
    except Exception as exc:  # outlines-core raises ValueError/TypeError/pyo3 errors
        raise UnsupportedSchemaError(f"cannot compile this JSON schema to a regex: {exc}. Remove or rewrite the "
                                     f"unsupported part (docs/generators.md lists what is supported)") from exc
    return regex, ignored


def outlines_regex(schema: Any, whitespace_pattern: str | None = r"[ ]?") -> str:
    """The outlines-core regex of a NORMALISED schema (see ``prepare_json_schema``); warns
    :class:`SchemaCoverageWarning` about what outlines-core will not enforce."""
    regex, ignored = outlines_regex_ignored(schema, whitespace_pattern)
    if ignored:
        warnings.warn(f"the JSON schema uses {sorted(ignored)}, which the outlines-core engine does not enforce: "
                      "outputs that violate them are refused by validation (SchemaViolationError)",
                      SchemaCoverageWarning, stacklevel=3)
    return regex
