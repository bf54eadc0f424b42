"""A schema placed inside another keeps its references: local ``$ref``s are rewritten to where it now lies.

A schema's local references (``#``, ``#/$defs/Pet``, ``#/definitions/...``, any JSON pointer) are
relative to ITS root. Placed under ``/properties/arguments`` of a tool call's envelope (or under
``/anyOf/1/properties/arguments`` of an envelope of several tools), ``#/$defs/Pet`` would point at the
envelope's root, where nothing is: pydantic's nested models and ``openai.pydantic_function_tool`` write
exactly such schemas. :func:`embed` prefixes every local reference with the place the schema goes, so
it resolves to the same subschema as before, recursive references (``#`` itself) included. Values
(``enum``, ``const``, ``default``, ``examples``) are data, not schemas: they are left as they are.

Example:
    >>> pet = {"type": "object", "properties": {"pet": {"$ref": "#/$defs/Pet"}},
    ...        "$defs": {"Pet": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Pet"}}}}}
    >>> out = embed(pet, "/properties/arguments")
    >>> out["properties"]["pet"], out["$defs"]["Pet"]["properties"]["next"]
    ({'$ref': '#/properties/arguments/$defs/Pet'}, {'$ref': '#/properties/arguments/$defs/Pet'})
"""

from __future__ import annotations

from typing import Any

__all__ = ["embed", "pointer"]

_VALUES = frozenset({"enum", "const", "default", "examples"})  # data, never schemas
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})  # name -> schema


def pointer(*parts: str | int) -> str:
    """The JSON pointer of ``parts`` (RFC 6901: ``~`` and ``/`` escaped), e.g. ``pointer("anyOf", 0)`` -> ``/anyOf/0``."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def embed(schema: Any, at: str) -> Any:
    """A copy of ``schema`` whose local references (``#...``) point where it lies once placed at the
    JSON pointer ``at`` of another schema (e.g. ``"/properties/arguments"``). Other values are shared."""
    if not at:
        return schema

    def node(value: Any) -> Any:
        if isinstance(value, list):
            return [node(v) for v in value]
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for key, v in value.items():
            if key == "$ref" and isinstance(v, str) and v.startswith("#") and (len(v) == 1 or v[1] == "/"):
                out[key] = "#" + at + v[1:]
            elif key in _VALUES:
                out[key] = v
            elif key in _MAPS and isinstance(v, dict):
                out[key] = {name: node(s) for name, s in v.items()}
            else:
                out[key] = node(v)
        return out

    return node(schema)
