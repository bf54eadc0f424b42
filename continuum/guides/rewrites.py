"""Rewrites of the keywords the engines do not enforce into ones they do (used by the normaliser).

Each function takes already-normalised subschemas and returns either an exact equivalent, or a
*narrower* schema (every instance it accepts is valid under the original: the sound side) together
with a note for the :class:`~continuum.guides.schema.SchemaCoverageWarning`, or raises
:class:`~continuum.errors.UnsupportedSchemaError` naming the keyword, its JSON path and what to do.

Example:
    >>> dependent_required({"a": ["b"]})
    [{'anyOf': [{'properties': {'a': False}}, {'required': ['a', 'b']}]}]
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..errors import UnsupportedSchemaError
from .logic import Resolve, _forbids, _key, _object_parts, disjoint, negate, types_of

Note = Callable[[str, str, str], None]  # (path, keyword, what is narrowed)


_ANNOT = {"title", "description", "$comment", "examples", "default", "markdownDescription", "deprecated"}


def switch(members: list) -> tuple[str, list, list] | None:
    """``allOf`` members that are ``if {"properties": {P: {"const"/"enum": ...}}} then T`` on one
    property ``P`` with disjoint values and no ``else`` (JsonSchemaStore's tagged unions):
    ``(P, [(values, T)...], other members)``, or None (fewer than 3 such cases).

    Rewritten as rewrites each ``if`` separately, their conjunction multiplies out (2^n branches);
    as cases it is ``anyOf[P in values_k and T_k]``: a narrowing (values without ``P``, or with a
    ``P`` no case names, are not generated)."""
    cases: list = []
    others: list = []
    prop: str | None = None
    seen: set[str] = set()
    for m in members:
        case = _case(m)
        if case is None or (prop is not None and case[0] != prop) or seen & {_key(v) for v in case[1]}:
            others.append(m)
            continue
        prop = case[0]
        seen |= {_key(v) for v in case[1]}
        cases.append(case[1:])
    return (prop, cases, others) if prop is not None and len(cases) >= 3 else None


def _case(member: Any) -> tuple[str, list, Any] | None:
    if not isinstance(member, dict) or set(member) - _ANNOT != {"if", "then"} or not isinstance(member["if"], dict):
        return None
    cond = {k: v for k, v in member["if"].items() if k not in _ANNOT}
    props = cond.pop("properties", None)
    if not isinstance(props, dict) or len(props) != 1:
        return None
    (name, sub), = props.items()
    if cond.pop("required", [name]) != [name] or cond.pop("type", "object") != "object" or cond or not isinstance(sub, dict):
        return None
    sub = {k: v for k, v in sub.items() if k not in _ANNOT}
    if set(sub) == {"const"}:
        return name, [sub["const"]], member["then"]
    if set(sub) == {"enum"} and isinstance(sub["enum"], list) and sub["enum"]:
        return name, list(sub["enum"]), member["then"]
    return None


def refuse(path: str, keyword: str, why: str, todo: str) -> UnsupportedSchemaError:
    where = f"{path}/{keyword}" if keyword else (path or "/")
    return UnsupportedSchemaError(f"the JSON schema keyword at {where} cannot be enforced: {why}. {todo}",
                                  keyword=keyword, path=where)


def all_of(parts: list) -> Any:
    """The conjunction of normalised schemas, with trivial parts dropped."""
    if any(p is False for p in parts):
        return False
    parts = [p for p in parts if p != {} and p is not True]
    return {} if not parts else parts[0] if len(parts) == 1 else {"allOf": parts}


def any_of(parts: list) -> Any:
    """The disjunction of normalised schemas: ``{}`` when a part accepts everything, ``False``
    branches dropped (a tautological ``anyOf`` beside other keywords makes llguidance intersect for nothing)."""
    if any(p == {} or p is True for p in parts):
        return {}
    parts = [p for p in parts if p is not False]
    return False if not parts else parts[0] if len(parts) == 1 else {"anyOf": parts}


_COUPLED = ({"properties", "patternProperties", "additionalProperties", "unevaluatedProperties"},
            {"prefixItems", "items", "unevaluatedItems"}, {"minimum", "exclusiveMinimum"}, {"maximum", "exclusiveMaximum"})


def conjoin(node: Any, parts: list) -> Any:
    """``node`` and every schema of ``parts`` (``allOf``), written as one schema where that is exact:
    a part whose keywords do not meet ``node``'s (nor keywords that read each other, such as
    ``properties`` and ``additionalProperties``) is merged in; ``required`` lists are unioned."""
    node = dict(node) if isinstance(node, dict) else node
    rest = []
    for part in parts:
        if part is False or node is False:
            return False
        if not isinstance(part, dict) or not isinstance(node, dict):
            rest.append(part)
            continue
        part = dict(part)
        if "required" in part and "required" in node:
            node["required"] = list(dict.fromkeys([*node["required"], *part.pop("required")]))
        keys = set(part)
        clash = keys & set(node) or any(keys & g and set(node) & g for g in _COUPLED)
        if clash or "$ref" in keys or "$ref" in node:
            rest.append(part)
        else:
            node.update(part)
    rest = [p for p in rest if p != {}]
    if not rest:
        return node
    return all_of([node, *rest]) if node else all_of(rest)


def dependent_required(value: dict) -> list:
    """``dependentRequired`` (draft-4/7 ``dependencies`` with a list): exact, as "absent or all present"."""
    return [{"anyOf": [{"properties": {name: False}}, {"required": [name, *needs]}]}
            for name, needs in value.items() if needs]


def dependent_schemas(value: dict) -> list:
    """``dependentSchemas`` (``dependencies`` with a schema): exact, as "absent, or present and valid"."""
    out = []
    for name, sub in value.items():
        if sub == {} or sub is True:
            continue
        out.append({"anyOf": [{"properties": {name: False}}, all_of([{"required": [name]}, sub])]})
    return out


def one_of(branches: list, path: str, resolve: Resolve, note: Note) -> Any:
    """``oneOf`` as ``anyOf``: exact when the branches are pairwise disjoint (different types,
    distinct ``const``/``enum`` values of a required property...). Each branch that overlaps another
    is cut down to "this branch and not that one": exactly when that one can be negated, else
    (object branches) by forbidding a property that one requires and this one does not (narrower)."""
    if len(branches) == 1:
        return branches[0]
    extra: list[list] = [[] for _ in branches]
    narrowed = []
    for i, mine in enumerate(branches):
        for j, other in enumerate(branches):
            if i == j or disjoint(mine, other, resolve):
                continue
            neg = negate(other, resolve)
            if neg is not None:
                extra[i].append(neg)
                continue
            cut = _excluding(mine, other, resolve)
            if cut is None:
                raise refuse(path, "oneOf", f"branches {i} and {j} may both match the same value, and no "
                             "engine enforces 'exactly one'", "Use anyOf if overlapping values are acceptable, "
                             "or add a discriminator (a required property with a distinct const in each branch)")
            extra[i].append(cut[0])
            narrowed.append(f"{cut[1]} in branch {i}")
    if narrowed:
        note(path, "oneOf", "overlapping object branches were made disjoint by forbidding, in a branch, a "
             f"property another requires, or requiring one another forbids ({', '.join(narrowed)})")
    return {"anyOf": [all_of([b, *e]) for b, e in zip(branches, extra)]}


def _excluding(mine: Any, other: Any, resolve: Resolve) -> tuple[dict, str] | None:
    """A constraint that, added to ``mine``, excludes every value of ``other`` (both object-only):
    forbid a property ``other`` requires, or require one of ``mine``'s properties ``other`` forbids."""
    if not (types_of(mine, resolve) <= {"object"} and types_of(other, resolve) <= {"object"}):
        return None
    parts_mine, parts_other = _object_parts(mine, resolve), _object_parts(other, resolve)
    for name in sorted(parts_other[0] - parts_mine[0]):
        if not _forbids(parts_mine, name, resolve):
            return {"properties": {name: False}}, f"forbidding {name!r}"
    for name in sorted(parts_mine[1]):
        if _forbids(parts_other, name, resolve) and not _forbids(parts_mine, name, resolve):
            return {"required": [name]}, f"requiring {name!r}"
    return None


def if_then_else(cond: Any, then: Any, other: Any, path: str, resolve: Resolve, note: Note) -> Any:
    """``if``/``then``/``else``: exact as ``anyOf[if and then, not-if and else]`` when ``if`` can be
    negated (``required``, ``type``, bounds...); otherwise ``anyOf[if and then, then and else]``, which
    drops the values that fail ``if`` and ``then`` but satisfy ``else`` (narrower)."""
    then = {} if then is None else then
    other = {} if other is None else other
    neg = negate(cond, resolve)
    if neg is not None:
        return any_of([all_of([cond, then]), all_of([neg, other])])
    note(path, "if", "`if` cannot be negated exactly: a value that fails `if` is generated only if it also "
         "satisfies `then`")
    return any_of([all_of([cond, then]), all_of([then, other])])


def not_(sub: Any, path: str, resolve: Resolve) -> Any:
    """``not``: replaced by the exact negation of its schema, or refused."""
    neg = negate(sub, resolve)
    if neg is None:
        raise refuse(path, "not", "its schema cannot be negated exactly (only type, required, properties, "
                     "numeric and length bounds, anyOf/allOf of those can)",
                     "Rewrite the condition positively (e.g. an enum of the allowed values)")
    return neg


def unique_items(node: dict, path: str, note: Note) -> None:
    """``uniqueItems: true``: an array of at most one item is always unique, so it becomes
    ``maxItems: 1`` (narrower) when ``minItems`` allows; refused otherwise. In place."""
    if node.pop("uniqueItems", False) is not True or node.get("maxItems", 2) <= 1:
        return
    if node.get("minItems", 0) > 1:
        raise refuse(path, "uniqueItems", f"no engine enforces distinct items and minItems={node['minItems']} "
                     "rules out the sound fallback (arrays of at most one item)",
                     "Drop uniqueItems and deduplicate after parsing, or lower minItems to 1")
    node["maxItems"] = 1
    note(path, "uniqueItems", "arrays are limited to one item (always unique)")


def contains(node: dict, path: str, note: Note) -> None:
    """``contains``: the first item must satisfy it (narrower). In place."""
    sub = node.pop("contains")
    lo, hi = node.pop("minContains", 1), node.pop("maxContains", None)
    if hi is not None or lo != 1:
        raise refuse(path, "contains", "minContains/maxContains are not enforced by any engine",
                     "Drop them, or list the items with prefixItems")
    if sub is False:
        node["minItems"], node["maxItems"] = 1, 0  # nothing can satisfy it
        return
    prefix = list(node.get("prefixItems", []))
    first = prefix[0] if prefix else node.get("items", {})
    node["prefixItems"] = [all_of([first, sub])] + prefix[1:]
    node["minItems"] = max(node.get("minItems", 0), 1)
    note(path, "contains", "the first item is the one that satisfies `contains`")


def property_names(node: dict, names: Any) -> bool:
    """``propertyNames`` as keys the engines enforce, in place; False when it cannot be written so.

    An ``enum``/``const`` of names becomes the only properties (exact); a ``pattern`` or length
    bounds become the one key pattern of the extra keys (``patternProperties``) with declared names
    that fail it forbidden (exact when extra keys take any value, else narrower: a declared name
    matching the pattern also takes the extra keys' schema)."""
    if names is False:
        node["properties"], node["additionalProperties"] = {}, False
        node.pop("patternProperties", None)
        return True
    if not isinstance(names, dict) or set(names) - {"type", "enum", "const", "pattern", "minLength", "maxLength"}:
        return False
    if names.get("type", "string") != "string" or "patternProperties" in node:
        return False
    extra = node.get("additionalProperties", {})
    props = dict(node.get("properties", {}))
    if "enum" in names or "const" in names:
        allowed = [names["const"]] if "const" in names else names["enum"]
        if not all(isinstance(n, str) for n in allowed) or set(names) - {"type", "enum", "const"}:
            return False
        node["properties"] = {n: props.get(n, extra) for n in allowed if props.get(n, extra) is not False}
        node["additionalProperties"] = False
        return True
    if "pattern" in names and ("minLength" in names or "maxLength" in names):
        return False
    if "pattern" in names:
        key = names["pattern"]
    else:
        lo, hi = names.get("minLength", 0), names.get("maxLength")
        key = f"^.{{{lo},{'' if hi is None else hi}}}$"
    try:
        ok = {n: re.search(key, n) is not None for n in props}
    except re.error:
        return False
    node["properties"] = {n: (v if ok[n] else False) for n, v in props.items()}
    node["patternProperties"], node["additionalProperties"] = {key: extra}, False
    return True
