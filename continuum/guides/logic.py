"""Reasoning about normalised JSON schemas: the types a schema admits, disjointness, exact negation.

These helpers work on schemas already normalised by :mod:`continuum.guides.normalize` (draft
2020-12 spelling, local ``$ref`` resolved through ``resolve``). Every answer errs on the safe side:
``disjoint`` returns True only when no instance can match both schemas, ``negate`` returns a schema
matching exactly the instances the input rejects, or None when it cannot say so exactly.

Example:
    >>> disjoint({"type": "string"}, {"type": "integer"}, lambda s: s)
    True
    >>> negate({"required": ["a"]}, lambda s: s)
    {'type': 'object', 'properties': {'a': False}}
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

Resolve = Callable[[Any], Any]
ALL_TYPES = frozenset({"null", "boolean", "object", "array", "string", "number", "integer"})
# "number" stands for the non-integer numbers here, so that `integer` and `number` can be told apart.
_TYPE_SETS = {"number": {"number", "integer"}, "integer": {"integer"}}


def _value_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names[type(value)]


def _key(value: Any) -> str:
    """A canonical, type-tagged key: JSON equality without Python's ``1 == True == 1.0`` pitfalls."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return _value_type(value) + ":" + json.dumps(value, sort_keys=True)


def values_of(schema: Any) -> set[str] | None:
    """The canonical keys of the only values ``schema`` admits (``const``/``enum``), or None."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return {_key(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {_key(v) for v in schema["enum"]}
    return None


def types_of(schema: Any, resolve: Resolve, depth: int = 0) -> frozenset[str]:
    """A superset of the JSON types of the instances ``schema`` admits."""
    schema = resolve(schema)
    if schema is False:
        return frozenset()
    if not isinstance(schema, dict) or depth > 20:
        return ALL_TYPES
    out = set(ALL_TYPES)
    t = schema.get("type")
    if t is not None:
        names = [t] if isinstance(t, str) else t
        out &= set().union(*(_TYPE_SETS.get(n, {n}) for n in names)) if names else set()
    if "const" in schema or isinstance(schema.get("enum"), list):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        out &= {_value_type(v) for v in values}
    for sub in schema.get("allOf", []):
        out &= types_of(sub, resolve, depth + 1)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            out &= set().union(*(types_of(s, resolve, depth + 1) for s in schema[key]))
    return frozenset(out)


def _object_parts(schema: Any, resolve: Resolve) -> tuple[set[str], dict[str, list], Any, bool]:
    """(required names, property schemas, additionalProperties, has patternProperties) of an
    object schema, gathered through ``allOf``."""
    schema = resolve(schema)
    required: set[str] = set()
    props: dict[str, list] = {}
    extra: Any = None
    patterns = False
    if not isinstance(schema, dict):
        return required, props, extra, patterns
    required |= set(schema.get("required", []))
    for name, sub in schema.get("properties", {}).items():
        props.setdefault(name, []).append(sub)
    if schema.get("additionalProperties") is False:
        extra = False
    patterns = bool(schema.get("patternProperties"))
    for sub in schema.get("allOf", []):
        r, p, e, pp = _object_parts(sub, resolve)
        required |= r
        for name, subs in p.items():
            props.setdefault(name, []).extend(subs)
        extra = False if e is False else extra
        patterns = patterns or pp
    return required, props, extra, patterns


def _forbids(parts, name: str, resolve: Resolve) -> bool:
    _, props, extra, patterns = parts
    if any(resolve(s) is False for s in props.get(name, [])):
        return True
    return extra is False and name not in props and not patterns


def disjoint(a: Any, b: Any, resolve: Resolve, depth: int = 0) -> bool:
    """True only if no JSON instance is valid under both ``a`` and ``b``."""
    a, b = resolve(a), resolve(b)
    if a is False or b is False:
        return True
    if depth > 10:
        return False
    common = types_of(a, resolve) & types_of(b, resolve)
    if not common:
        return True
    va, vb = values_of(a), values_of(b)
    if va is not None and vb is not None and not (va & vb):
        return True
    if common <= {"object"}:
        pa, pb = _object_parts(a, resolve), _object_parts(b, resolve)
        for (req, props, _, _), other in ((pa, pb), (pb, pa)):
            for name in sorted(req):
                if _forbids(other, name, resolve):
                    return True
                mine, theirs = props.get(name, []), other[1].get(name, [])
                if any(disjoint(x, y, resolve, depth + 1) for x in mine for y in theirs):
                    return True
    return False


# --- exact negation -------------------------------------------------------------------------

_TYPE_OF_KEY = {
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number", "exclusiveMaximum": "number",
    "minLength": "string", "maxLength": "string", "minItems": "array", "maxItems": "array",
    "minProperties": "object", "maxProperties": "object",
}
_OPPOSITE = {"minimum": "exclusiveMaximum", "maximum": "exclusiveMinimum",
             "exclusiveMinimum": "maximum", "exclusiveMaximum": "minimum"}
_COUNT = {"minLength": "maxLength", "maxLength": "minLength", "minItems": "maxItems", "maxItems": "minItems",
          "minProperties": "maxProperties", "maxProperties": "minProperties"}


def _negate_type(t: Any) -> dict | bool | None:
    names = set().union(*(_TYPE_SETS.get(n, {n}) for n in ([t] if isinstance(t, str) else t)))
    rest = ALL_TYPES - names
    if "number" in rest and "integer" not in rest:
        return None  # "every number that is not an integer" has no spelling without `not`
    spelled = sorted(rest - {"integer"}) if "number" in rest else sorted(rest)
    return {"type": spelled} if spelled else False


def _negate_clause(key: str, value: Any, resolve: Resolve, depth: int) -> list | None:
    """Schemas whose union is exactly the instances failing the single keyword ``key: value``."""
    if key == "type":
        neg = _negate_type(value)
        return None if neg is None else ([] if neg is False else [neg])
    if key == "required":
        return [{"type": "object", "properties": {name: False}} for name in value]
    if key == "properties":
        out = []
        for name, sub in value.items():
            neg = negate(sub, resolve, depth + 1)
            if neg is None:
                return None
            if neg is not False:
                out.append({"type": "object", "required": [name], "properties": {name: neg}})
        return out
    if key in _OPPOSITE and isinstance(value, (int, float)) and not isinstance(value, bool):
        return [{"type": "number", _OPPOSITE[key]: value}]
    if key in _COUNT and isinstance(value, int):
        kind = _TYPE_OF_KEY[key]
        if key.startswith("min"):
            return [] if value <= 0 else [{"type": kind, _COUNT[key]: value - 1}]
        return [{"type": kind, _COUNT[key]: value + 1}]
    if key == "anyOf":  # not (A or B) = not A and not B
        negs = [negate(s, resolve, depth + 1) for s in value]
        if any(n is None for n in negs):
            return None
        return [] if any(n is False for n in negs) else [{"allOf": negs}] if len(negs) > 1 else negs
    if key == "allOf":
        out = []
        for sub in value:
            neg = negate(sub, resolve, depth + 1)
            if neg is None:
                return None
            if neg is not False:
                out.append(neg)
        return out
    return None


def negate(schema: Any, resolve: Resolve, depth: int = 0) -> Any:
    """A schema valid for exactly the instances ``schema`` rejects, ``False`` when it accepts
    everything, or None when that cannot be written without ``not``."""
    schema = resolve(schema)
    if schema is False:
        return {}
    if schema is True or schema == {}:
        return False
    if not isinstance(schema, dict) or depth > 10 or "$ref" in schema:
        return None
    pieces: list = []
    for key, value in schema.items():
        clause = _negate_clause(key, value, resolve, depth)
        if clause is None:
            return None
        pieces.extend(clause)
    if not pieces:
        return False
    return pieces[0] if len(pieces) == 1 else {"anyOf": pieces}
