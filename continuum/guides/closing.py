"""Strict objects and bounded keys: the last pass over a normalised schema, before the engines.

* **Closed objects** (``additional_properties=False``, the default of ``generate.json``): an object
  schema that says nothing about extra keys (no ``additionalProperties``, ``patternProperties`` or
  ``unevaluatedProperties`` anywhere in its ``allOf``/``anyOf`` group) gets
  ``additionalProperties: false`` with every name its group declares (``properties`` and
  ``required`` of the node and of its subschemas) listed in ``properties``. Every output still
  validates against the original schema (a narrowing), and a model can no longer wander into keys
  the schema never named. xgrammar's strict mode and OpenAI's strict structured outputs do the same.
* **Bounded keys** (``max_key_length``, from ``max_string_length``): a schema that does allow extra
  keys gets them as a ``patternProperties`` entry whose pattern matches only names of at most that
  many characters that are not declared properties (``additionalProperties: false`` then refuses
  the rest); a ``patternProperties`` pattern gets its repetitions bounded (``*`` -> ``{0,n}``...) and
  anchored (extra keys beside ``patternProperties`` stay unbounded: llguidance wants disjoint key
  patterns, and the complement of a pattern has no spelling). Both narrow soundly: a generated key
  matches what the original allowed, and its value satisfies every schema the original applies to
  it.

Example:
    >>> close_objects({"type": "object", "properties": {"ok": {"type": "boolean"}}})
    {'type': 'object', 'properties': {'ok': {'type': 'boolean'}}, 'additionalProperties': False}
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["close_objects", "bounded_key_pattern", "excluding_pattern"]

_GROUP = ("allOf", "anyOf", "oneOf")
_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_OBJECT_KEYS = {"properties", "required", "minProperties", "maxProperties", *_OPENERS}
_CHILD_MAPS = ("properties", "patternProperties", "$defs")
_CHILD_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "contains")
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _esc(c: str) -> str:
    return "\\" + c if c in _REGEX_META else c


def excluding_pattern(names: list[str], max_len: int) -> str:
    """An anchored regex (Rust syntax) of the strings of at most ``max_len`` characters that are
    none of ``names``: a trie of the names, where a string leaves the trie or stops at a node that
    ends no name."""
    trie: dict = {}
    for name in names:
        if len(name) <= max_len:
            node = trie
            for c in name:
                node = node.setdefault(c, {})
            node[""] = {}

    def walk(node: dict, depth: int) -> str | None:
        """The regex of the rests that, after this trie node, make a non-name (None: no rest does)."""
        left, stop_ok = max_len - depth, "" not in node  # stopping here is fine unless a name ends here
        alts = []
        if left > 0:
            kids = sorted(k for k in node if k)
            cls = "[^" + "".join(_esc(k) for k in kids) + "]" if kids else "."
            alts.append(cls + (f".{{0,{left - 1}}}" if left > 1 else ""))
            alts.extend(_esc(k) + sub for k in kids if (sub := walk(node[k], depth + 1)) is not None)
        if not alts:
            return "" if stop_ok else None
        return "(?:" + "|".join(alts) + ")" + ("?" if stop_ok else "")

    root = walk(trie, 0)
    assert root is not None  # max_len >= 1 (bounds.resolve_bounds): the root always has a one-character rest
    return "^" + root + "$"


_QUANT = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|\{(\d+),\}|[*+]")


def _matches_every_key(pattern: str) -> bool:
    """Whether ``pattern`` (search semantics) matches every key without a line break: ``.*``, ``^.*$``,
    ``(.*)``, ``^``, ``$``, ``""``... (an explicit spelling; any other pattern is bounded as written)."""
    body = pattern
    start = body.startswith("^")
    body = body[1:] if start else body
    end = body.endswith("$") and not body.endswith("\\$")
    body = body[:-1] if end else body
    for opener in ("(?:", "("):
        if body.startswith(opener) and body.endswith(")") and "(" not in body[len(opener):] and ")" not in body[:-1]:
            body = body[len(opener):-1]
    return body in (".*", ".*?") or (body == "" and not (start and end))


def bounded_key_pattern(pattern: str, max_len: int) -> str | None:
    """A regex matching only keys that ``pattern`` matches (search semantics), each repetition
    bounded by ``max_len`` (so the key is bounded) and anchored; None when the pattern cannot be
    read safely (it then stays as is)."""
    if _matches_every_key(pattern):
        return f"^.{{0,{max_len}}}$"
    body, start, end = pattern, False, False
    if body.startswith("^"):
        body, start = body[1:], True
    if body.endswith("$") and (len(body) - 1 - len(body[:-1].rstrip("\\"))) % 2 == 0:
        body, end = body[:-1], True

    def bound(m: re.Match) -> str:
        tok = m.group(0)
        if tok == "*":
            return f"{{0,{max_len}}}"
        if tok == "+":
            return f"{{1,{max_len}}}"
        if m.group(1) is not None:
            lo = int(m.group(1))
            return f"{{{lo},{max(lo, max_len)}}}"
        return tok  # an escape or a character class: copied as is

    try:
        bounded = _QUANT.sub(bound, body)
        re.compile(bounded)
    except re.error:
        return None
    return ("^" + ("" if start else f".{{0,{max_len}}}") + f"(?:{bounded})" + ("" if end else f".{{0,{max_len}}}")
            + "$")


def _search(pattern: str, name: str) -> bool | None:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return None


class _Closer:
    def __init__(self, root: Any, additional: bool, max_len: int | None):
        self.root, self.additional, self.max_len = root, additional, max_len
        self.memo: dict[int, Any] = {}
        self.members_memo: dict[int, Any] = {}

    def deref(self, node: Any) -> Any:
        seen = 0
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/$defs/") \
                and seen < 50 and isinstance(self.root, dict):
            node, seen = self.root.get("$defs", {}).get(node["$ref"][8:], {}), seen + 1
        return node

    def group(self, node: Any, out: list, depth: int = 0) -> None:
        """``node`` and the subschemas that apply to the same instance (allOf/anyOf/oneOf, through refs)."""
        node = self.deref(node)
        if not isinstance(node, dict) or depth > 30:
            return
        out.append(node)
        for key in _GROUP:
            for sub in node.get(key, []) if isinstance(node.get(key), list) else []:
                self.group(sub, out, depth + 1)

    def instance(self, node: Any) -> Any:
        """A schema applied to an instance (the root, a property value, an item...): closed, and its
        children closed."""
        if not isinstance(node, dict):
            return node
        if set(node) == {"$ref"}:
            return node  # its target is closed where it is defined ($defs)
        key = id(node)
        if key not in self.memo:
            self.memo[key] = node  # a cycle through $defs reads the node as it was
            self.memo[key] = self._instance(node)
        return self.memo[key]

    def _instance(self, node: dict) -> dict:
        members: list = []
        self.group(node, members)
        objectish = any(_OBJECT_KEYS & set(m) or m.get("type") == "object"
                        or (isinstance(m.get("type"), list) and "object" in m["type"]) for m in members)
        explicit = any(k in m and m[k] is not False for m in members for k in _OPENERS)  # (false closes)
        out = self.member(node)
        if objectish and not explicit and not self.additional:
            names: dict[str, None] = {}
            for m in members:
                names.update(dict.fromkeys(m.get("properties", {}) if isinstance(m.get("properties"), dict) else {}))
                names.update(dict.fromkeys(n for n in m.get("required", []) if isinstance(n, str)))
            props = dict(out.get("properties", {}))
            props.update({n: {} for n in names if n not in props})
            if isinstance(out.get("allOf"), list) and not (_OBJECT_KEYS & set(out)):  # a conjunction: one more part
                out = {**out, "allOf": [*out["allOf"], {"properties": props, "additionalProperties": False}]}
            else:
                out = {**out, "properties": props, "additionalProperties": False}
        return out

    def member(self, node: dict) -> dict:
        """A member of a group: its children closed as instances, its group members rebuilt, its
        extra keys bounded."""
        key = id(node)
        if key in self.members_memo:
            return self.members_memo[key]
        out = dict(node)
        for k in _CHILD_MAPS:
            if isinstance(out.get(k), dict):
                out[k] = {n: self.instance(v) for n, v in out[k].items()}
        for k in _CHILD_ONE:
            if isinstance(out.get(k), dict):
                out[k] = self.instance(out[k])
        if isinstance(out.get("prefixItems"), list):
            out["prefixItems"] = [self.instance(v) for v in out["prefixItems"]]
        for k in _GROUP:
            if isinstance(out.get(k), list):
                out[k] = [self.member(v) if isinstance(v, dict) else v for v in out[k]]
        if self.max_len is not None:
            out = self.bound_keys(out)
        self.members_memo[key] = out
        return out

    def bound_keys(self, node: dict) -> dict:
        """Extra keys (``additionalProperties`` other than false, ``patternProperties``) bounded to
        ``max_len`` characters; unchanged when a pattern cannot be bounded safely."""
        objectish = "properties" in node or node.get("type") == "object"
        extra = node.get("additionalProperties", {} if self.additional and objectish else None)
        patterns = node.get("patternProperties")
        if (extra is None or extra is False) and not patterns:
            return node
        if "unevaluatedProperties" in node or (patterns is not None and not isinstance(patterns, dict)):
            return node
        patterns = patterns or {}
        max_len = self.max_len
        assert max_len is not None  # member() calls bound_keys only with a bound
        bounded = {p: bounded_key_pattern(p, max_len) for p in patterns}
        keys = [b for b in bounded.values() if b is not None]
        if len(keys) < len(bounded):
            return node
        props = dict(node.get("properties", {}))
        for name in list(props):  # a declared name the original patterns match keeps their schemas
            hits = [patterns[p] for p in patterns if _search(p, name)]
            if any(_search(p, name) is None for p in patterns):
                return node
            if hits:
                props[name] = {"allOf": [props[name], *hits]}
        every = [s for s in patterns.values() if s not in ({}, True)]
        out_patterns: dict[str, Any] = {}
        for b in keys:
            # a key may match several original patterns: its value satisfies all of them (sound)
            out_patterns[b] = {"allOf": every} if len(every) > 1 else (every[0] if every else {})
        parts = [s for s in [extra, *patterns.values()] if s not in ({}, True, None, False)]
        value = {"allOf": parts} if len(parts) > 1 else parts[0] if parts else {}
        if extra is None or extra is False:
            extra = False
        elif not patterns:  # llguidance wants disjoint key patterns: the extra keys' one excludes the declared names
            out_patterns[excluding_pattern(list(props), max_len)] = value
            extra = False
        else:  # extra keys beside patterns stay unbounded; a long key a pattern matched still gets its schema
            extra = value
        out = {k: v for k, v in node.items() if k != "patternProperties"}
        out.update({"properties": props, "patternProperties": out_patterns, "additionalProperties": extra})
        if not props:
            del out["properties"]
        return out


def close_objects(schema: Any, *, additional_properties: bool = False, max_key_length: int | None = None) -> Any:
    """``schema`` (normalised) with closed objects (unless ``additional_properties``) and, when
    ``max_key_length`` is given, bounded extra keys; see the module docstring."""
    if not isinstance(schema, dict) or (additional_properties and max_key_length is None):
        return schema
    closer = _Closer(schema, additional_properties, max_key_length)
    out = closer.instance(schema)
    return out
