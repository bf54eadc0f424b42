"""The JSON Schema normaliser in front of the engines (engine-agnostic: schema dict in, schema dict out).

:func:`normalize_schema` rewrites a schema of any draft (4, 6, 7, 2019-09, 2020-12) into a draft
2020-12 schema the engines (outlines-core, llguidance) can enforce:

* local ``$ref`` (``#``, ``#/$defs/...``, ``#/definitions/...``, any JSON pointer) are inlined;
  recursive ones stay references into ``$defs``; remote references are refused;
* annotations and keywords the schema's draft does not define are dropped (validators ignore them);
  ``format`` is kept only where an engine enforces it (:data:`ENFORCED_FORMATS`): elsewhere it is an
  annotation (``jsonschema`` does not assert it by default), so dropping it is exact;
* legacy spellings become 2020-12 ones: tuple ``items`` -> ``prefixItems``, ``additionalItems`` ->
  ``items``, boolean ``exclusiveMinimum``, ``dependencies`` -> ``dependentRequired``/``dependentSchemas``;
* keywords no engine enforces are rewritten (see :mod:`continuum.guides.rewrites`): exactly when
  possible (``dependentRequired``, disjoint ``oneOf``, ``not`` and ``if`` on negatable schemas), else
  onto the SOUND side: a narrower schema whose every instance is valid under the original (noted in
  :attr:`NormalizedSchema.narrowed`), else :class:`~continuum.errors.UnsupportedSchemaError` naming the
  keyword and its JSON path;
* ``max_string_length`` bounds strings that have no ``maxLength`` (no ``format``/``pattern``/``enum``);
  ``max_items`` bounds arrays that have no ``maxItems`` (an explicit bound is never tightened; a
  ``minItems`` above ``max_items`` is refused, as no array could satisfy both); ``bounds`` also
  bounds numbers, format strings and open objects (:mod:`continuum.guides.bounds`).

Example:
    >>> normalize_schema({"type": "object", "properties": {"t": {"$ref": "#/$defs/tag"}},
    ...                   "$defs": {"tag": {"type": "string", "format": "color"}}}).schema
    {'type': 'object', 'properties': {'t': {'type': 'string'}}}
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ..errors import UnsupportedSchemaError
from . import rewrites as rw
from .bounds import JsonBounds, bound_numbers, bounds_note, resolve_bounds
from .combinators import COMBINATORS, combinator
from .limits import check_schema_bounds
from .metaschemas import metaschema as _metaschema

__all__ = ["normalize_schema", "NormalizedSchema", "dialect_of", "ENFORCED_FORMATS"]

# Formats llguidance 1.9 enforces (it refuses the others); outlines-core 0.2 knows a subset and
# schema.py drops the rest for it. Any string is valid for an unasserted format, so every narrowing
# a format brings is sound.
ENFORCED_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6",
                              "uuid", "uri"})
_DRAFTS = {"draft-03": "draft4", "draft-04": "draft4", "draft-06": "draft6", "draft-07": "draft7",
           "2019-09": "2019-09", "2020-12": "2020-12"}
_LEGACY_ITEMS = {"draft4", "draft6", "draft7", "2019-09"}  # tuple `items` + `additionalItems`
_SUB_MAPS = ("properties", "patternProperties", "dependentSchemas")
_SUB_ONE = ("additionalProperties", "propertyNames", "contains", "unevaluatedProperties", "unevaluatedItems")
_COPY = ("type", "enum", "const", "required", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
         "multipleOf", "minLength", "maxLength", "pattern", "minItems", "maxItems", "uniqueItems", "minProperties",
         "maxProperties", "minContains", "maxContains", "dependentRequired")
_NOT_IN = {"draft4": {"const", "contains", "propertyNames", "if", "dependentRequired", "dependentSchemas",
                      "prefixItems", "unevaluatedProperties", "unevaluatedItems", "minContains", "maxContains"},
           "draft6": {"if", "dependentRequired", "dependentSchemas", "prefixItems", "unevaluatedProperties",
                      "unevaluatedItems", "minContains", "maxContains"},
           "draft7": {"dependentRequired", "dependentSchemas", "prefixItems", "unevaluatedProperties",
                      "unevaluatedItems", "minContains", "maxContains"},
           "2019-09": {"prefixItems", "dependencies"}, "2020-12": {"dependencies", "additionalItems"}}
_FLOAT_MAX = 1.7976931348623157e308
_INLINE_BUDGET = 200_000  # nodes; past it, refs stay references into $defs


@dataclass(frozen=True)
class Narrowing:
    """Where the normalised schema accepts fewer values than the original, and how."""

    path: str
    keyword: str
    note: str

    def __str__(self) -> str:
        return f"{self.path or '/'} {self.keyword}: {self.note}"


@dataclass(frozen=True)
class NormalizedSchema:
    """A normalised schema (draft 2020-12), what it narrows, and the original's draft."""

    schema: Any
    narrowed: tuple[Narrowing, ...]
    dialect: str
    #: keywords dropped or widened (``approximate=True``): NOT enforced, outputs must be validated
    approximated: tuple[Narrowing, ...] = ()


def dialect_of(schema: Any) -> str:
    """The draft whose semantics apply: ``$schema`` when given; without it, draft 2020-12 unless
    the schema uses draft-4/7-only spellings (boolean ``exclusiveMinimum`` -> draft 4; tuple
    ``items``, ``additionalItems`` or ``dependencies`` -> draft 7)."""
    if isinstance(schema, dict) and isinstance(schema.get("$schema"), str):
        for tag, name in _DRAFTS.items():
            if tag in schema["$schema"]:
                return name
    found: set[str] = set()

    def scan(node: Any, key: str = "") -> None:
        if isinstance(node, dict):
            if key not in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
                if isinstance(node.get("exclusiveMinimum"), bool) or isinstance(node.get("exclusiveMaximum"), bool):
                    found.add("draft4")
                if isinstance(node.get("items"), list) or "additionalItems" in node or "dependencies" in node:
                    found.add("draft7")
            for k, v in node.items():
                if k not in ("enum", "const", "default", "examples"):
                    scan(v, k)
        elif isinstance(node, list):
            for v in node:
                scan(v, key)

    scan(schema)
    return "draft4" if "draft4" in found else "draft7" if found else "2020-12"


def _pointer(root: Any, ref: str, path: str) -> Any:
    node = root
    for part in ref[1:].lstrip("/").split("/") if ref not in ("#", "#/") else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise rw.refuse(path, "$ref", f"{ref!r} points to nothing in this schema", "Fix the reference") from None
    return node


class _Normalizer:
    def __init__(self, root: Any, dialect: str, max_string_length: int | None, inline: bool,
                 approximate: bool = False, max_items: int | None = None, relax: bool = False):
        self.root, self.dialect, self.max_len, self.inline = root, dialect, max_string_length, inline
        self.max_items, self.relax = max_items, relax
        self.bounded: dict[int, tuple[dict, set]] = {}  # id -> (node, the maxLength/maxItems the bounds added)
        self.approximate = approximate
        self.narrowed: list[Narrowing] = []
        self.approximated: list[Narrowing] = []
        self.done: dict[str, Any] = {}  # ref -> normalised target
        self.stack: list[str] = []
        self.names: dict[str, str] = {}  # ref -> name in the output's $defs
        self.size: dict[int, int] = {}
        self.inexact: set[str] = set()  # refs whose normalised target is not exact
        self.inexact_uses = 0

    def mark(self) -> tuple[int, int, int]:
        """A mark that changes when a schema normalised after it is not exact (widened or narrowed)."""
        return len(self.approximated), len(self.narrowed), self.inexact_uses

    def exact(self, value: Any, path: str) -> tuple[Any, bool]:
        """(``value`` normalised, whether exactly): a schema that gets negated (``not``, ``if``,
        ``oneOf`` branches) must be exact, as negation turns a widening into a narrowing."""
        mark = self.mark()
        out = self.norm(value, path)
        return out, self.mark() == mark

    def note(self, path: str, keyword: str, what: str) -> None:
        if self.relax:  # no narrowing: the caller widens instead
            raise rw.refuse(path, keyword, "narrowing is off (relax)", "")
        self.narrowed.append(Narrowing(f"{path}/{keyword}", keyword, what))

    def relaxed(self, path: str, keyword: str, what: str) -> bool:
        """``relax``: note that ``keyword`` is widened (``what``) instead of narrowed; False otherwise."""
        if self.relax:
            self.approximated.append(Narrowing(f"{path}/{keyword}", keyword, what))
        return self.relax

    def widen(self, exc: UnsupportedSchemaError, fallback: Any, what: str) -> Any:
        """``approximate``: ``fallback`` (wider: the keyword is not enforced) in place of a refusal."""
        if not self.approximate:
            raise exc
        self.approximated.append(Narrowing(exc.path or "/", exc.keyword or "", what))
        return fallback

    def resolve(self, node: Any) -> Any:
        """A `$ref`-only node's target, for the analyses (unknown while the target is in progress)."""
        while isinstance(node, dict) and set(node) == {"$ref"} and node["$ref"].startswith("#/$defs/"):
            ref = next((r for r, n in self.names.items() if f"#/$defs/{n}" == node["$ref"]), None)
            if ref not in self.done:
                return node
            node = self.done[ref]
        return node

    def ref(self, ref: Any, path: str) -> Any:
        meta = _metaschema(ref)
        if meta is None and (not isinstance(ref, str) or not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/")):
            raise rw.refuse(path, "$ref", f"{ref!r} is not a local JSON-pointer reference (#/...)",
                            "Inline the referenced schema, or move it under $defs and use '#/$defs/<name>'")
        if ref in self.inexact:
            self.inexact_uses += 1
        if ref in self.stack or (not self.inline and ref in self.done):
            return {"$ref": "#/$defs/" + self._name(ref)}
        if ref not in self.done:
            self.stack.append(ref)
            mark = self.mark()
            fragment = "#" + ref.partition("#")[2] if meta is not None else ref
            self.done[ref] = self.norm(_pointer(meta if meta is not None else self.root, fragment, path),
                                       ref[1:] if meta is None else ref)
            if self.mark() != mark:
                self.inexact.add(ref)
            self.stack.pop()
        return self.done[ref] if self.inline else {"$ref": "#/$defs/" + self._name(ref)}

    def _name(self, ref: str) -> str:
        if ref not in self.names:
            base = (re.sub(r"[^A-Za-z0-9_.$-]", "_", ref.partition("#")[2][1:].replace("/", ".")) or "root")[-60:]
            if not ref.startswith("#"):  # a metaschema's definition
                base = "meta." + base
            name, n = base, 1
            while name in self.names.values():
                n, name = n + 1, f"{base}.{n}"
            self.names[ref] = name
        return self.names[ref]

    def norm(self, node: Any, path: str) -> Any:
        if node is True:
            return {}
        if node is False:
            return False
        if not isinstance(node, dict):
            raise rw.refuse(path, "", f"a schema must be an object or a boolean, got {type(node).__name__}",
                            "Fix the schema")
        if "$ref" in node:
            target = self.ref(node["$ref"], path)  # unresolvable: refused always (the output could not be validated)
            if self.dialect in ("draft4", "draft6", "draft7"):
                return target  # siblings of $ref are ignored before 2019-09
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return rw.all_of([target, self.norm(rest, path)]) if rest else target
        skip = _NOT_IN[self.dialect]
        out: dict[str, Any] = {}
        extra: list = []  # conjuncts from rewritten keywords
        for key, value in node.items():
            if key in skip:
                continue
            here = f"{path}/{key}"
            if key in _SUB_MAPS and isinstance(value, dict):
                out[key] = {k: self.norm(v, f"{here}/{k}") for k, v in value.items()}
            elif key in _SUB_ONE:
                out[key] = self.norm(value, here)
            elif key == "items":
                if isinstance(value, list):
                    out["prefixItems"] = [self.norm(v, f"{here}/{i}") for i, v in enumerate(value)]
                    if "additionalItems" in node:
                        out["items"] = self.norm(node["additionalItems"], f"{path}/additionalItems")
                else:
                    out["items"] = self.norm(value, here)
            elif key == "prefixItems":
                out[key] = [self.norm(v, f"{here}/{i}") for i, v in enumerate(value)]
            elif key in COMBINATORS:
                combinator(self, key, value, node, path, extra)
            elif key == "format":
                if value in ENFORCED_FORMATS:
                    out[key] = value
            elif key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
                bound = "minimum" if key == "exclusiveMinimum" else "maximum"
                if value and bound in node:
                    out[key] = node[bound]
            elif key in _COPY:
                out[key] = value
        if self.dialect == "draft4":  # a boolean exclusive bound replaces its inclusive one
            for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
                if node.get(key) is True and bound in out:
                    del out[bound]
        self._post(out, path, extra)
        return rw.conjoin(out, extra) if extra else out

    def _post(self, out: dict, path: str, extra: list) -> None:
        """The in-place rewrites of one node (after its subschemas are normalised)."""
        if out.get("uniqueItems") is True and out.get("maxItems", 2) > 1 and self.relaxed(path, "uniqueItems",
                                                                                    "dropped: items may repeat"):
            out.pop("uniqueItems")
        if "contains" in out and self.relaxed(path, "contains", "dropped: no item is required to satisfy it"):
            out.pop("contains"), out.pop("minContains", None), out.pop("maxContains", None)
        if "uniqueItems" in out:
            try:
                rw.unique_items(out, path, self.note)
            except UnsupportedSchemaError as exc:
                self.widen(exc, out.pop("uniqueItems", None), "dropped: items may repeat")
        if "contains" in out:
            try:
                rw.contains(out, path, self.note)  # pops contains/minContains/maxContains before refusing
            except UnsupportedSchemaError as exc:
                self.widen(exc, None, "dropped with minContains/maxContains: the items are not counted")
        elif "minContains" in out or "maxContains" in out:
            out.pop("minContains", None), out.pop("maxContains", None)  # no effect without contains
        if "dependentRequired" in out:
            extra.extend(rw.dependent_required(out.pop("dependentRequired")))
        if "dependentSchemas" in out:
            extra.extend(rw.dependent_schemas(out.pop("dependentSchemas")))
        if "propertyNames" in out:
            names = out.pop("propertyNames")
            if names != {} and not rw.property_names(out, names):
                self.widen(rw.refuse(path, "propertyNames", "no engine constrains property names",
                                     "List the allowed names under properties with additionalProperties: false, "
                                     "or use patternProperties"), None, "dropped: any property name may be generated")
        if self.max_len is not None and "maxLength" not in out and not ({"format", "pattern", "enum", "const"} & set(out)):
            t = out.get("type")
            if t == "string" or (isinstance(t, list) and "string" in t):
                out["maxLength"] = max(self.max_len, out.get("minLength", 0))
                self.bounded.setdefault(id(out), (out, set()))[1].add("maxLength")
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = out.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) >= 1e300:
                if abs(value) < _FLOAT_MAX and not self.approximate:
                    continue
                del out[key]  # every finite JSON number is within it (larger ones parse as inf)
                if abs(value) < _FLOAT_MAX:  # llguidance cannot write such a range as a regex
                    self.approximated.append(Narrowing(f"{path}/{key}", key, f"{value:g}: dropped (a bound that "
                                                       "large is not enforced)"))
        if self.max_items is not None and "maxItems" not in out and _arrayish(out):
            low = out.get("minItems", 0)
            if isinstance(low, (int, float)) and low > self.max_items:
                raise UnsupportedSchemaError(
                    f"the array at {path or '/'} has minItems={low}, above max_items={self.max_items} (which bounds "
                    f"arrays without maxItems): pass max_items={int(low)} or more, or None", keyword="minItems",
                    path=f"{path}/minItems")
            out["maxItems"] = self.max_items
            self.bounded.setdefault(id(out), (out, set()))[1].add("maxItems")

    def expanded_size(self, node: Any) -> int:
        """Nodes of ``node`` once written out (shared subtrees counted at each use)."""
        key = id(node)
        if key not in self.size:
            if isinstance(node, dict):
                self.size[key] = 1 + sum(self.expanded_size(v) for v in node.values())
            elif isinstance(node, list):
                self.size[key] = 1 + sum(self.expanded_size(v) for v in node)
            else:
                return 1
        return self.size[key]


def _arrayish(node: dict) -> bool:
    """Whether ``node`` (normalised) may accept an array whose length it does not bound itself."""
    t = node.get("type")
    if t is None:
        return any(k in node for k in ("items", "prefixItems", "minItems", "contains"))
    return t == "array" or (isinstance(t, list) and "array" in t)


def normalize_schema(schema: Any, *, max_string_length: int | None = None, approximate: bool = False,
                     max_items: int | None = None, relax: bool = False, inline: bool = True,
                     bounds: JsonBounds | None = None) -> NormalizedSchema:
    """Normalise ``schema`` (a dict or bool) for the engines; see the module docstring.

    Raises :class:`~continuum.errors.UnsupportedSchemaError` (with ``.keyword`` and ``.path``) for a
    keyword that no engine enforces and that has no sound rewrite; with ``approximate=True`` that
    keyword is dropped or widened instead (``oneOf`` -> ``anyOf``, ``not`` dropped...) and listed in
    :attr:`NormalizedSchema.approximated`. ``max_items`` bounds every array without ``maxItems``.
    ``relax=True`` (with ``approximate``) widens where it would narrow (``oneOf`` -> ``anyOf``,
    ``uniqueItems`` and ``contains`` dropped...), so the result accepts every valid value: the
    fallback when a narrowing left nothing. ``inline=False`` keeps every reference a ``$ref`` into
    ``$defs`` (a smaller schema for the engines' size limits). ``bounds`` (None: none) bounds strings,
    arrays and numbers without bounds of their own; ``max_string_length``/``max_items`` override its.
    """
    limits = resolve_bounds(bounds, max_string_length, max_items)  # also checks max_string_length, max_items
    max_string_length, max_items = limits.max_string_length, limits.max_items
    check_schema_bounds(schema)  # depth, size, enum: before any recursive walk
    dialect = dialect_of(schema)
    for inline_refs in (True, False)[0 if inline else 1:]:
        n = _Normalizer(schema, dialect, max_string_length, inline_refs, approximate, max_items, relax)
        n.stack.append("#")
        out = n.norm(schema, "")
        n.done["#"] = out
        if not inline_refs or n.expanded_size(out) <= _INLINE_BUDGET:
            break
    if n.names:
        defs = {n.names[r]: n.done[r] for r in list(n.names)}
        out = {"allOf": [out], "$defs": defs} if not isinstance(out, dict) or "$defs" in out else {**out, "$defs": defs}
    out, bounded = bound_numbers(out, limits, n.bounded)  # after every rewrite: only positive positions remain
    note = bounds_note(limits, bounded)
    narrowed = n.narrowed + ([Narrowing("", "bounds", note)] if note else [])
    return NormalizedSchema(out, tuple(narrowed), dialect, tuple(n.approximated))
