"""The draft-4/6/7 metaschemas, the only remote documents a schema's ``$ref`` may point into:
``jsonschema`` bundles them, so they are known without a fetch (JsonSchemaStore's swagger-2.0
refers to ``http://json-schema.org/draft-04/schema#/properties/title`` and its siblings).

Example:
    >>> metaschema("http://json-schema.org/draft-04/schema#/properties/title")["properties"]["title"]
    {'type': 'string'}
"""

from __future__ import annotations

from typing import Any

__all__ = ["metaschema"]

_METASCHEMAS = {"http://json-schema.org/draft-04/schema": "Draft4Validator",
                "http://json-schema.org/draft-06/schema": "Draft6Validator",
                "http://json-schema.org/draft-07/schema": "Draft7Validator"}


def metaschema(ref: Any) -> dict | None:
    """The draft-4/6/7 metaschema a remote ``ref`` points into (its own references made absolute,
    so they stay inside it), or None: these are the only remote documents known without a fetch."""
    if not isinstance(ref, str) or "#" not in ref:
        return None
    name = _METASCHEMAS.get(ref.partition("#")[0].rstrip("/"))
    if name is None:
        return None
    import jsonschema

    base = ref.partition("#")[0]

    def absolute(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (base + v if k == "$ref" and isinstance(v, str) and v.startswith("#") else absolute(v))
                    for k, v in node.items()}
        return [absolute(v) for v in node] if isinstance(node, list) else node

    return absolute(getattr(jsonschema, name).META_SCHEMA)
