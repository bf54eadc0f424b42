"""Key patterns that overlap declared properties, spelled so llguidance never intersects schemas.

JSON Schema applies a ``patternProperties`` entry to EVERY key its pattern matches, declared
properties included: ``{"properties": {"by": P}, "patternProperties": {".*": Q}}`` makes ``by``
satisfy ``P`` and ``Q``. llguidance computes that intersection while compiling, and it cannot when
``P`` or ``Q`` refers back to a definition still being compiled (a recursive ``$ref``): it refuses
with "circular references with sibling keys are not supported" (the WashingtonPost ANS schemas,
every one of them). The exact rewrite here removes the intersection: the pattern is narrowed to the
keys it matches that are NOT declared (a trie of the declared names, see :func:`excluding`), and a
declared name it matched gets ``P`` and ``Q`` itself: ``P`` alone when ``Q`` is ``P`` or ``{}`` (the
usual case: the same schema written twice), else ``allOf[P, Q]``. Patterns whose complement this
cannot spell (anything but "every key" and ``^[class]*$``-like patterns) are left as they were.
When ``allOf[P, Q]`` itself refers to a recursive definition, llguidance still refuses it: the
approximate fallback of ``json_for`` then gives the property ``P`` alone (``widened``), validated.

Example:
    >>> split_overlaps({"type": "object", "properties": {"a": {"type": "integer"}},  # doctest: +NORMALIZE_WHITESPACE
    ...                 "patternProperties": {".*": {"type": "integer"}}})
    {'type': 'object', 'properties': {'a': {'type': 'integer'}},
     'patternProperties': {'^(?:[^a\\\\n].*|a(?:.+))?$': {'type': 'integer'}}}
"""

from __future__ import annotations

import json
import re
from typing import Any

from .walk import SchemaRewriter

__all__ = ["excluding", "merge_patterns", "split_overlaps"]

_NON_ASCII = ("\u00e9", "\u6771", "\U0001f600", "\u00a0", "\u0660", "\u212a")
_META = set("\\.+*?()|[]{}^$#&-~")
# patterns that match every key (search semantics): "", ".*", "^.*$", "^[...]*" (nothing after the star)
_EVERY = re.compile(r"\^?(?:\.\*)?\$?|\^(?:\[(?:\\.|[^\]\\])+\]|\((?:\?:)?\[(?:\\.|[^\]\\])+\]\))\*")
# ^[class]*$ or ^[class]+$ (optionally grouped): the keys made of that class only
_CLASS_RUN = re.compile(r"\^(?:\[((?:\\.|[^\]\\])+)\]|\((?:\?:)?\[((?:\\.|[^\]\\])+)\]\))([*+])\$")


def _esc(c: str) -> str:
    return "\\" + c if c in _META else c


def excluding(names: list[str], cls: str | None = None, nonempty: bool = False) -> str:
    """An anchored regex (Rust syntax) of the strings over ``cls`` (the inside of an ASCII character
    class; None: any character but a newline, like ``.``) that are none of ``names``, of any length
    (at least one character when ``nonempty``). Every name must be made of ``cls`` characters."""
    trie: dict = {}
    for name in names:
        node = trie
        for c in name:
            node = node.setdefault(c, {})
        node[""] = {}
    anyc = "." if cls is None else f"[{cls}]"
    members = [chr(i) for i in range(128) if cls is not None and re.fullmatch(anyc, chr(i))]

    def other(kids: list[str]) -> str:
        if not kids:
            return anyc
        if cls is None:
            return "[^" + "".join(_esc(k) for k in kids) + "\\n]"
        return "[" + "".join(_esc(c) for c in members if c not in kids) + "]"

    def walk(node: dict, root: bool) -> str:
        kids = sorted(k for k in node if k)
        alts = [other(kids) + anyc + "*" if kids else anyc + "+"]
        alts += [_esc(k) + walk(node[k], False) for k in kids]
        # stopping here is fine unless a name ends here (or it is the root of a nonempty pattern)
        stop_ok = "" not in node and not (root and nonempty)
        return "(?:" + "|".join(alts) + ")" + ("?" if stop_ok else "")

    return "^" + walk(trie, True) + "$"


def _minus(pattern: str, names: list[str]) -> str | None:
    """``pattern`` without ``names`` (all matched by it), or None when that cannot be spelled."""
    if _EVERY.fullmatch(pattern):
        if any("\n" in n for n in names):
            return None
        return excluding(names)
    m = _CLASS_RUN.fullmatch(pattern)
    if m:
        cls = m.group(1) or m.group(2)
        try:
            if "[" in cls or cls.startswith("^") or any(re.fullmatch(f"[{cls}]", c) for c in _NON_ASCII):
                return None  # nested or negated classes, or non-ASCII members: not spelled here
        except re.error:
            return None
        return excluding(names, cls, nonempty=m.group(3) == "+")
    return None


def _search(pattern: str, name: str) -> bool | None:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return None


class _Splitter(SchemaRewriter):
    def __init__(self, widened: list | None) -> None:
        super().__init__()
        self.widened = widened

    def conj(self, p: Any, q: Any, name: str, pattern: str) -> Any:
        if q in ({}, True) or q == p:
            return p
        if p in ({}, True):
            return q
        if p is False or q is False:
            return False
        if self.widened is not None:
            self.widened.append(f"property {name!r}: the schema of patternProperties {pattern!r} is not applied to it "
                                "(llguidance cannot intersect schemas with recursive references)")
            return p
        return {"allOf": [p, q]}

    def _node(self, node: dict) -> dict:
        out = {}
        for k, v in node.items():
            if k in ("enum", "const"):
                out[k] = v
            elif k in ("properties", "patternProperties", "$defs", "dependentSchemas") and isinstance(v, dict):
                out[k] = {n: self.node(s) for n, s in v.items()}
            else:
                out[k] = self.node(v)
        props, patterns = out.get("properties"), out.get("patternProperties")
        if not (isinstance(props, dict) and isinstance(patterns, dict) and props and patterns):
            return out
        props, new_patterns = dict(props), {}
        for pattern, sub in patterns.items():
            hits = [n for n in props if _search(pattern, n)]
            spelled = _minus(pattern, hits) if hits and all(_search(pattern, n) is not None for n in props) else None
            if spelled is None or spelled in patterns or spelled in new_patterns:
                new_patterns[pattern] = sub
                continue
            new_patterns[spelled] = sub
            for n in hits:
                props[n] = self.conj(props[n], sub, n, pattern)
        return {**out, "properties": props, "patternProperties": new_patterns}


def split_overlaps(schema: Any, widened: list | None = None) -> Any:
    """``schema`` (normalised) with every ``patternProperties`` pattern that matches declared
    properties narrowed to the other keys (exact; see the module docstring).

    ``widened``: a list: where a declared property would get ``allOf[P, Q]``, it gets ``P`` alone
    (a WIDER schema: outputs must be validated), and the list gets a note per property."""
    return _Splitter(widened).node(schema)


def merge_patterns(schema: Any, widened: list) -> Any:
    """``schema`` with the ``patternProperties`` of every object that has several merged into one
    pattern (their alternation) whose schema is the ``anyOf`` of theirs: llguidance wants disjoint
    key patterns, and two patterns may overlap. A WIDER schema (a key matching both gets either
    schema): outputs must be validated; ``widened`` gets a note per object."""
    memo: dict[int, Any] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        if id(node) in memo:
            return memo[id(node)]
        memo[id(node)] = node
        out = {k: v if k in ("enum", "const") else
               {n: walk(s, f"{path}/{k}/{n}") for n, s in v.items()} if k in ("properties", "patternProperties", "$defs")
               and isinstance(v, dict) else walk(v, f"{path}/{k}") for k, v in node.items()}
        patterns = out.get("patternProperties")
        if isinstance(patterns, dict) and len(patterns) > 1:
            subs = list({json.dumps(s, sort_keys=True): s for s in patterns.values()}.values())
            out["patternProperties"] = {"|".join(f"(?:{p})" for p in patterns): subs[0] if len(subs) == 1
                                        else {"anyOf": subs}}
            widened.append(f"{path or '/'}/patternProperties: its {len(patterns)} patterns are merged into one (a key "
                           "matching several gets one of their schemas, not all)")
        memo[id(node)] = out
        return out

    return walk(schema, "")
