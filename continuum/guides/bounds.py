"""Bounds on what JSON generation writes where the schema sets none: numbers, strings, arrays, keys.

A weak model given ``{"type": "integer"}`` may write digits until its context ends (stories260K
greedy writes ``-3000000000...``); an unbounded string or array does the same. A
:class:`JsonBounds` says how long such values may be; ``generate.json``, ``JSONLogitsProcessor``
and the server take one as ``bounds=`` (a preset name, an instance, or None for no bounds):

* ``"default"``: numbers only, bounds a strict-mode user does not notice: integer parts of at most
  18 digits (every integer fits an int64), fractions of at most 10 digits, no exponent;
* ``"small"``: for small or weakly trained models: strings of at most 32 characters (64 for a string
  with a ``format``: a date-time's fractional seconds are unbounded otherwise), arrays of at most 8
  items, objects that allow extra keys of at most 8 properties, integer parts of at most 9 digits,
  fractions of at most 4; and the value as a whole is bounded (``whole_value``, below);
* ``None`` / ``"none"``: nothing bounded (the JSON Schema as written).

Numbers are bounded in the normalised schema (:func:`bound_numbers`) with standard keywords, so
both engines see them: ``exclusiveMinimum``/``exclusiveMaximum`` of -/+ 10**digits (llguidance
writes a bounded range as a fixed number of digits, without exponent) and ``multipleOf``
10**-fraction_digits (a decimal with at most that many fraction digits). Only what the schema
leaves open is bounded: a side that has a bound of its own keeps it (a ``maximum`` of 1e30 keeps its
31 digits), a ``multipleOf`` already bounds the fraction, and the added bound always leaves room for
the schema's other side. A bound is a narrowing: every output is still valid, and is validated
against the original schema as always.

``whole_value`` (``"small"``) bounds the size of the whole value, not only each leaf, so that it fits
a small context (a 512-token model filled it in 20% of the sample with per-leaf bounds alone):

* **bounds shrink inside containers**: inside the items of arrays (and the values of maps, objects
  with extra keys) of n repeated values in all (the product of their ``maxItems``/``maxProperties``),
  the item count, property count, string length and map key length this module adds are divided
  by n, down to 1 item (or property) and :data:`~continuum.guides.whole.NESTED_LENGTH` (8)
  characters: an array of 8 rows of 8 strings of 32 characters becomes 8 rows of 1 string of 8;
* **open values are bounded too**: a schema without ``type`` gets the number, string and array bounds
  (each keyword constrains only its own type), a schema that allows any value at all (``{}``) is
  generated as a scalar (null, boolean, number or string), an array without ``items`` gets such
  items, and a string whose ``pattern`` leaves the length open (unanchored, or ``+``/``*``) gets
  the pattern spelled bounded (as generated keys are);
* **extra keys that cannot be counted are not generated**: llguidance counts keys (``maxProperties``)
  only where every declared property is required; an object with extra keys and an optional declared
  property gets its declared properties only (unless it sets ``maxProperties`` itself, or a key
  pattern also matches a declared property, or ``anyOf``/``allOf``/``$ref`` may declare more).

A bound the schema sets itself (``maxItems``, ``maxLength``, ``maxProperties``, an anchored pattern of
bounded length) is never divided nor tightened; ``minItems``/``minLength``/``minProperties`` always
fit. Each rule is named in the coverage warning. Where the whole-value form does not compile (a
divided bound below a minimum another ``allOf`` member sets, or llguidance's size limits), ``json_for``
compiles the schema with the per-leaf bounds alone.

Example:
    >>> bound_numbers({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}},
    ...               JsonBounds(integer_digits=3))[0]["properties"]["n"]
    {'type': 'integer', 'minimum': 0, 'exclusiveMaximum': 1000, 'x-continuum-bounds': ['exclusiveMaximum']}
    >>> resolve_bounds("small")
    JsonBounds(max_string_length=32, max_items=8, integer_digits=9, fraction_digits=4, max_properties=8, whole_value=True)
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..errors import GeneratorArgumentError, UnsupportedSchemaError
from .whole import NESTED_LENGTH, SCALAR, bound_pattern, close_open_object, short_keys

__all__ = ["JsonBounds", "BOUNDS", "resolve_bounds", "bound_numbers", "MARKER", "bounds_note"]

#: The keywords :func:`bound_numbers` added to a node (for the engines that spell them otherwise).
MARKER = "x-continuum-bounds"
# llguidance writes a range through i64 and a multipleOf through a u32 coefficient: past these, it refuses.
_MAX_INTEGER_DIGITS = 18
_MAX_FRACTION_DIGITS = 10


@dataclass(frozen=True)
class JsonBounds:
    """How long generated JSON values may be where the schema sets no bound (None: unbounded).

    Attributes:
        max_string_length: characters of a string without ``maxLength`` (and of a generated key).
        max_items: items of an array without ``maxItems``.
        integer_digits: digits of the integer part of a number without ``minimum``/``maximum`` on a
            side (1-18; numbers so bounded are written without exponent).
        fraction_digits: digits after the decimal point of a number without ``multipleOf`` (0-10).
        max_properties: properties of an object that allows extra keys (``additionalProperties`` other
            than false, or ``patternProperties``) and has no ``maxProperties``; only where every declared
            property is required (llguidance counts keys only then).
        whole_value: bound the value as a whole, not only each leaf (see :func:`bound_numbers`):
            bounds shrink inside arrays, untyped values and strings with an unanchored ``pattern`` are
            bounded, and an object with extra keys and optional declared properties gets its declared
            properties only.
    """

    max_string_length: int | None = None
    max_items: int | None = None
    integer_digits: int | None = 18
    fraction_digits: int | None = 10
    max_properties: int | None = None
    whole_value: bool = False

    def __post_init__(self) -> None:
        for name, low, high in (("max_string_length", 1, None), ("max_items", 1, None), ("max_properties", 1, None),
                                ("integer_digits", 1, _MAX_INTEGER_DIGITS), ("fraction_digits", 0, _MAX_FRACTION_DIGITS)):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low or (high and value > high):
                span = f"an int from {low} to {high}" if high else f"an int >= {low}"
                why = {"integer_digits": " (llguidance writes number ranges within int64)",
                       "fraction_digits": " (llguidance writes decimal multipleOf down to 1e-10)"}.get(name, "")
                raise GeneratorArgumentError(f"JsonBounds.{name} must be {span} or None, got {value!r}{why}")
        if not isinstance(self.whole_value, bool):
            raise GeneratorArgumentError(f"JsonBounds.whole_value must be True or False, got {self.whole_value!r}")

    @property
    def numbers(self) -> bool:
        """Whether numbers are bounded at all."""
        return self.integer_digits is not None or self.fraction_digits is not None

    @property
    def any(self) -> bool:
        """Whether :func:`bound_numbers` has anything to do."""
        return self.numbers or self.max_properties is not None or self.max_string_length is not None \
            or self.max_items is not None


#: The presets ``bounds=`` may name.
BOUNDS = {"default": JsonBounds(), "small": JsonBounds(32, 8, 9, 4, 8, whole_value=True),
          "none": JsonBounds(None, None, None, None)}
#: Characters a string with a ``format`` gets at least (a uuid has 36, a date-time ~20 before its fraction).
FORMAT_LENGTH = 64
_SCALE = 1 << 12  # the product of enclosing item counts stops growing here (every division is at its floor)
#: ``whole_value``: what a node without ``type`` may be (each keyword a bound adds constrains only its type).
_ANY = frozenset({"integer", "number", "string", "array", "object"})
_EMPTY: dict = {}  # the items of an array without ``items`` (never mutated: the walk copies)


def resolve_bounds(bounds: Any, max_string_length: int | None = None, max_items: int | None = None) -> JsonBounds:
    """The :class:`JsonBounds` of a ``bounds=`` argument (a preset name, an instance or None), with
    ``max_string_length``/``max_items`` (the older keywords) overriding theirs when given.

    Raises :class:`~continuum.errors.GeneratorArgumentError` for anything else, or a bad value.
    """
    for name, value in (("max_string_length", max_string_length), ("max_items", max_items)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UnsupportedSchemaError(f"{name} must be a positive int or None, got {value!r}")
    if bounds is None:
        base = BOUNDS["none"]
    elif isinstance(bounds, str) and bounds in BOUNDS:
        base = BOUNDS[bounds]
    elif isinstance(bounds, JsonBounds):
        base = bounds
    else:
        raise GeneratorArgumentError(f"bounds must be one of {', '.join(map(repr, BOUNDS))}, a JsonBounds or None, "
                                     f"got {bounds!r:.80}")
    changes: dict[str, Any] = {k: v for k, v in (("max_string_length", max_string_length), ("max_items", max_items))
                               if v is not None}
    return dataclasses.replace(base, **changes) if changes else base


def _number(value: Any) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _digits(value: float | int | None) -> int:
    """Digits of the integer part of ``|value|`` (0 for None; huge floats count their exponent)."""
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return 0
    return len(str(int(abs(value))))


def _limit(digits: int, beyond: float | int | None) -> float | int:
    """10**digits, or the next power of ten above ``beyond`` (the schema's bound on the other side,
    facing this one) when that is larger, so the range stays non-empty; a float past int64, which
    llguidance cannot read as an integer."""
    value = 10 ** max(digits, _digits(beyond) if beyond is not None and beyond >= 10 ** digits else 0)
    return value if value < 2 ** 63 else float(value)


def _side(nodes: list[dict], inclusive: str, exclusive: str) -> float | int | None | bool:
    """The schema's own bound on one side (the tightest number, or True when only a non-number is set)."""
    found = [v for n in nodes for v in (n.get(inclusive), n.get(exclusive)) if v is not None]
    numbers = [v for v in map(_number, found) if v is not None]
    return (max(numbers) if inclusive == "minimum" else min(numbers)) if numbers else bool(found)


def _bound_one(node: dict, seen: list[dict], bounds: JsonBounds, ours: set, scale: int) -> list[str]:
    """Bound one node in place (``seen``: it and the ``allOf`` members read with it; ``ours``: the
    ``maxLength``/``maxItems`` the normaliser's bounds added to it; ``scale``: the repeated values of
    the arrays and maps around it, with ``whole_value``); the kinds of bounds added."""
    t = node.get("type")
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()
    if "enum" in node or "const" in node:
        return []
    added: list[str] = []
    kinds: list[str] = []
    untyped = not types and bounds.whole_value and len(seen) == 1 and not {"$ref", "anyOf", "oneOf", "allOf"} & set(node)
    if untyped and not node:  # any value at all: a scalar
        node["type"] = list(SCALAR)
        kinds.append("any")
    types = set(node.get("type", _ANY)) if untyped else types
    if types & {"integer", "number"} and bounds.integer_digits is not None:
        low, high = _side(seen, "minimum", "exclusiveMinimum"), _side(seen, "maximum", "exclusiveMaximum")
        if high is False:
            node["exclusiveMaximum"] = _limit(bounds.integer_digits, _number(low))
            added.append("exclusiveMaximum")
        if low is False:
            node["exclusiveMinimum"] = -_limit(bounds.integer_digits, -(_number(high) or 0))
            added.append("exclusiveMinimum")
    if "number" in types and bounds.fraction_digits is not None and not any("multipleOf" in n for n in seen):
        node["multipleOf"] = float(f"1e-{bounds.fraction_digits}") if bounds.fraction_digits else 1
        added.append("multipleOf")
    kinds += ["number"] if added else []  # (an "any" node counts as both)
    if "string" in types and bounds.max_string_length is not None and not any("maxLength" in n for n in seen):
        if bounds.whole_value and isinstance(node.get("pattern"), str) and "format" not in node:
            pattern = bound_pattern(node["pattern"], bounds.max_string_length)
            if pattern is not None:
                node["pattern"] = pattern  # (not in MARKER: outlines-core gets the narrower pattern too)
                kinds.append("pattern")
        elif "format" in node or untyped:
            length = bounds.max_string_length if scale == 1 else max(NESTED_LENGTH, bounds.max_string_length // scale)
            node["maxLength"] = max(FORMAT_LENGTH if "format" in node else length, node.get("minLength", 0))
            added.append("maxLength")
            kinds += ["maxLength"] if "format" in node else [] if "any" in kinds else ["untyped"]
    if untyped and "array" in types and bounds.max_items is not None and "maxItems" not in node \
            and node.get("minItems", 0) <= bounds.max_items:
        node["maxItems"] = max(1, bounds.max_items // scale, node.get("minItems", 0))
        added.append("maxItems")
    if scale > 1 and "maxLength" in ours and bounds.max_string_length is not None:
        node["maxLength"] = max(NESTED_LENGTH, bounds.max_string_length // scale, node.get("minLength", 0))
        kinds.append("nested")
    if scale > 1 and "maxItems" in ours and bounds.max_items is not None:
        node["maxItems"] = max(1, bounds.max_items // scale, node.get("minItems", 0))
        kinds.append("nested")
    if bounds.max_properties is not None and not any("maxProperties" in n for n in seen):
        if _open_object(node, types):
            count = bounds.max_properties if scale == 1 else max(1, bounds.max_properties // scale)
            node["maxProperties"] = max(count, node.get("minProperties", 0), len(node.get("required", [])))
            added.append("maxProperties")
            kinds.append("maxProperties" if scale == 1 else "nested")
            if scale > 1 and short_keys(node, bounds.max_string_length, scale):
                kinds.append("nested")
        elif bounds.whole_value and len(seen) == 1 and close_open_object(node, types):
            kinds.append("closed")
    if added:
        node[MARKER] = added
    return kinds


def _open_object(node: dict, types: set) -> bool:
    """An object schema with extra keys whose count llguidance can bound (every declared property required)."""
    if types and "object" not in types or not isinstance(node.get("properties", {}), dict):
        return False
    extra = node.get("additionalProperties", False) is not False or bool(node.get("patternProperties"))
    required = node.get("required", [])
    return extra and isinstance(required, list) and set(node.get("properties", {})) <= set(required)


# Where a normalised schema keeps subschemas in positive position (narrowing them narrows the whole).
# Not `not`, `if`/`then`/`else` or `oneOf`: narrowing under a negation would widen.
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "contains")
_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs")
_LISTS = ("anyOf", "allOf", "prefixItems")


def bound_numbers(schema: Any, bounds: JsonBounds, added: dict[int, tuple[dict, set]] | None = None
                  ) -> tuple[Any, Counter]:
    """(a copy of the NORMALISED ``schema`` with every number it leaves unbounded bounded, and every
    string with a ``format`` and open object under ``bounds``; how many nodes of each kind were).
    Shared subtrees stay shared; a bound in an ``allOf`` member counts for its siblings. ``added``:
    the nodes whose ``maxLength``/``maxItems`` the normaliser added for ``bounds`` (by id).

    With ``bounds.whole_value`` the value as a whole is bounded: inside the items of arrays of up to
    n items in all (the product of the ``maxItems`` around), the added ``maxItems`` and string
    ``maxLength`` are divided by n (at least 1 item, :data:`NESTED_LENGTH` characters, and the
    schema's ``minItems``/``minLength``); a node without ``type`` gets every bound its types would
    (its number, string, array and object bounds constrain only values of those types); a string
    whose ``pattern`` leaves its length open gets a ``maxLength``; and an object with extra keys and
    optional declared properties (llguidance cannot count its keys) gets its declared properties only."""
    count: Counter = Counter()
    if not bounds.any:
        return schema, count
    memo: dict[tuple, Any] = {}
    added = added or {}

    def walk(node: Any, inherited: tuple = (), scale: int = 1) -> Any:
        if not isinstance(node, dict):
            return node
        key = (id(node), tuple(map(id, inherited)), scale)
        if key in memo:
            return memo[key]
        members = [m for m in node.get("allOf", []) if isinstance(m, dict)] if isinstance(node.get("allOf"), list) else []
        out: dict[str, Any] = {}
        for k, v in node.items():
            if k == "items" and bounds.whole_value and _number(node.get("maxItems")):
                out[k] = walk(v, (), min(_SCALE, scale * max(1, int(node["maxItems"]))))
            elif k in ("additionalProperties", "patternProperties") and bounds.whole_value:  # a map's values
                many = _number(node.get("maxProperties")) or bounds.max_properties or 1
                inner = min(_SCALE, scale * max(1, int(many)))
                out[k] = {n: walk(sub, (), inner) for n, sub in v.items()} if k == "patternProperties" \
                    and isinstance(v, dict) else walk(v, (), inner)
            elif k in _ONE:
                out[k] = walk(v, (), scale)
            elif k in _MAPS and isinstance(v, dict):
                out[k] = {name: walk(sub, (), scale if k != "$defs" else 1) for name, sub in v.items()}
            elif k == "allOf" and isinstance(v, list):
                out[k] = [walk(sub, (node, *inherited, *(m for m in members if m is not sub)), scale) for sub in v]
            elif k in _LISTS and isinstance(v, list):
                out[k] = [walk(sub, (), scale) for sub in v]
            else:
                out[k] = v
        t = node.get("type")
        if bounds.whole_value and "items" not in node and (t == "array" or isinstance(t, list) and "array" in t) \
                and not members and not inherited and not {"$ref", "anyOf", "oneOf"} & set(node):  # lone: items of its own
            out["items"] = walk(_EMPTY, (), min(_SCALE, scale * max(1, int(_number(node.get("maxItems")) or 1))))
        mine = added.get(id(node))
        count.update(_bound_one(out, [out, *members, *inherited], bounds, mine[1] if mine and mine[0] is node else set(),
                                scale))
        memo[key] = out
        return out

    return walk(schema), count


def bounds_note(bounds: JsonBounds, count: Counter) -> str | None:
    """The coverage warning's words for the bounds :func:`bound_numbers` applied, or None (none, or
    only the default number bounds: like closed objects, strict JSON by default, documented rather
    than warned about on every schema with a number)."""
    parts = []
    if count["number"] and (bounds.integer_digits, bounds.fraction_digits) != (18, 10):
        limits = [f"integer part <= {bounds.integer_digits} digits, no exponent" if bounds.integer_digits else "",
                  f"fraction <= {bounds.fraction_digits} digits" if bounds.fraction_digits is not None else ""]
        parts.append(f"{count['number']} number schema(s) ({', '.join(p for p in limits if p)})")
    if count["maxLength"]:
        length = max(bounds.max_string_length or 0, FORMAT_LENGTH)
        parts.append(f"{count['maxLength']} string schema(s) with a format (<= {length} characters)")
    if count["maxProperties"]:
        parts.append(f"{count['maxProperties']} object schema(s) with extra keys (<= {bounds.max_properties} properties)")
    if count["pattern"]:
        parts.append(f"{count['pattern']} string schema(s) whose pattern leaves the length open "
                     f"(<= {bounds.max_string_length} characters, or what the pattern needs)")
    if count["any"]:
        parts.append(f"{count['any']} schema(s) that allow any value (generated as a null, boolean, number or string)")
    if count["untyped"]:
        parts.append(f"{count['untyped']} schema(s) without type (its strings, arrays and numbers as above)")
    if count["nested"]:
        parts.append(f"{count['nested']} array or string schema(s) inside arrays (bounds divided by the items around "
                     f"them: >= 1 item, >= {NESTED_LENGTH} characters)")
    if count["closed"]:
        parts.append(f"{count['closed']} object schema(s) with extra keys and optional properties (declared "
                     "properties only: the keys could not be counted)")
    return f"bounded where the schema sets no bound: {'; '.join(parts)} (bounds=None lifts this)" if parts else None
