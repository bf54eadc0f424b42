"""The rules of ``JsonBounds.whole_value`` (``bounds="small"``) that rewrite a node beyond a length or count.

Used by :func:`continuum.guides.bounds.bound_numbers` on a NORMALISED schema; each is a narrowing
(every value the rewritten node accepts, the original accepts), and each leaves alone what the
schema bounds itself.
"""

from __future__ import annotations

import re

from .closing import bounded_key_pattern
from .regex_size import _parser
from .regex_size import c as _c  # (Python's regex parser, under its name on this version: see regex_size.py)

__all__ = ["NESTED_LENGTH", "SCALAR", "bound_pattern", "short_keys", "close_open_object"]

_MAXREPEAT = int(_c.MAXREPEAT)
#: The fewest characters a string (or map key) inside containers is cut to (the fewest items: 1).
NESTED_LENGTH = 8
#: What a schema that allows any value at all (``{}``) is generated as.
SCALAR = ("null", "boolean", "integer", "number", "string")


def bound_pattern(pattern: str, length: int) -> str | None:
    """A pattern that leaves a string's length open (unanchored, or an unbounded
    repetition: ``[0-9]+``) spelled bounded, as generated keys are (:func:`~continuum.guides.closing.bounded_key_pattern`:
    every repetition at most ``length``, at most ``length`` characters around an unanchored match);
    a narrowing. None when it bounds the length already, repeats a group, or cannot be read."""
    if re.search(r"\)[*+{]", pattern):
        return None  # a repeated group: bounding each repetition makes a regex llguidance may not compile
    try:
        low, high = _parser.parse(pattern).getwidth()
    except (re.error, OverflowError, RecursionError, ValueError, TypeError):
        return None
    if pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$") and high < _MAXREPEAT:
        return None
    return bounded_key_pattern(pattern, max(length, low))


def short_keys(node: dict, max_string_length: int | None, scale: int) -> bool:
    """The keys of a map (extra keys only: no declared properties, no key patterns) inside containers
    of ``scale`` repeated values in all, as short as a string there (at least :data:`NESTED_LENGTH`):
    ``additionalProperties`` becomes the value schema of keys of that length (a narrowing), in place;
    whether it did."""
    extra = node.get("additionalProperties", False)
    if max_string_length is None or extra is False or node.get("properties") or node.get("patternProperties") \
            or "propertyNames" in node or "unevaluatedProperties" in node:
        return False
    length = max(NESTED_LENGTH, max_string_length // scale)
    node["patternProperties"], node["additionalProperties"] = {f"^.{{0,{length}}}$": extra}, False
    return True


def close_open_object(node: dict, types: set) -> bool:
    """An object schema with extra keys (which llguidance cannot count beside optional
    properties) given its declared properties only, in place. Only a lone node (no ``$ref``, ``anyOf``,
    ``oneOf`` or ``allOf`` that could declare more properties), with ``required`` among its declared
    properties, ``minProperties`` they can meet, and no key pattern that matches a declared property
    (its schema would apply there too); whether it closed it."""
    props, required = node.get("properties"), node.get("required", [])
    if types and "object" not in types or not isinstance(props, dict) or not props or not isinstance(required, list) \
            or {"$ref", "anyOf", "oneOf", "allOf", "unevaluatedProperties"} & set(node) \
            or not set(required) <= set(props) or node.get("minProperties", 0) > len(props):
        return False
    patterns = node.get("patternProperties") or {}
    if node.get("additionalProperties", False) is False and not patterns or not isinstance(patterns, dict):
        return False
    for pattern in patterns:
        for name in props:
            try:
                if re.search(pattern, name) is not None:
                    return False  # the declared property gets both schemas: left to the engine
            except re.error:
                return False
    node["additionalProperties"] = False
    node.pop("patternProperties", None)
    return True
