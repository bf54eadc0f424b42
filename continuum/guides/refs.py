"""Recursive references beside other keywords, spelled so llguidance can compile them.

llguidance compiles ``allOf`` (and the keywords beside an ``anyOf``) by intersecting schemas, and
intersecting with a ``$ref`` resolves it; a recursive ``$ref`` whose definition is still being
compiled cannot be resolved, and llguidance refuses the whole schema ("circular references with
sibling keys are not supported"). Two exact rewrites remove those intersections:

* a ``type`` beside an ``anyOf``/``oneOf`` that every branch already implies is dropped (the
  WashingtonPost ANS schemas: ``{"type": "object", "anyOf": [{"$ref": ...}, ...]}``);
* otherwise a ``$ref`` that would be intersected with ``parts`` (its ``allOf`` siblings, or the
  keywords beside its ``anyOf``) becomes a reference to a NEW definition, ``allOf[body, *parts]``
  with ``body`` the referenced definition written out: the intersection then happens while that new
  definition is compiled, on a schema, not on a reference in progress. New definitions are
  memoised by content and capped (:data:`MAX_NEW_DEFS`), so recursion cannot unroll forever.

Example:
    >>> s = {"$defs": {"n": {"type": "object", "properties": {"k": {"$ref": "#/$defs/n"}}}},
    ...      "allOf": [{"$ref": "#/$defs/n"}, {"required": ["k"]}]}
    >>> out = lift_refs(s)
    >>> out["$ref"], out["$defs"][out["$ref"][8:]]
    ('#/$defs/n&49903d6e33', {'type': 'object', 'properties': {'k': {'$ref': '#/$defs/n'}}, 'allOf': [{'required': ['k']}]})
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .logic import types_of
from .walk import SchemaRewriter

__all__ = ["MAX_NEW_DEFS", "lift_refs"]

MAX_NEW_DEFS = 200
_GROUPS = ("anyOf", "oneOf")


def _ref_name(node: Any) -> str | None:
    if isinstance(node, dict) and set(node) == {"$ref"} and isinstance(node["$ref"], str) \
            and node["$ref"].startswith("#/$defs/"):
        return node["$ref"][8:]
    return None


class _Lifter(SchemaRewriter):
    def __init__(self, root: dict, widened: list | None = None):
        self.widened = widened
        self.defs: dict[str, Any] = dict(root.get("$defs", {}))
        self.new: dict[str, str] = {}  # content key -> new def name
        super().__init__()

    def resolve(self, node: Any) -> Any:
        seen = 0
        while (name := _ref_name(node)) is not None and name in self.defs and seen < 50:
            node, seen = self.defs[name], seen + 1
        return node

    def lifted(self, name: str, parts: list) -> dict:
        """A reference to the new definition ``allOf[body of name, *parts]``."""
        if len(self.new) >= MAX_NEW_DEFS:
            return {"allOf": [{"$ref": f"#/$defs/{name}"}, *parts]}
        key = json.dumps([name, parts], sort_keys=True, default=str)
        if key not in self.new:
            new = f"{name[:40]}&{hashlib.sha1(key.encode()).hexdigest()[:10]}"
            self.new[key] = new
            body = self.defs[name]
            if isinstance(body, dict) and "$ref" not in body:  # the parts join the body's own conjunction
                self.defs[new] = {**body, "allOf": [*(body.get("allOf") or []), *parts]}
            else:
                self.defs[new] = {"allOf": [body, *parts]}  # lifted in its turn by run()
        return {"$ref": f"#/$defs/{self.new[key]}"}

    def _node(self, node: dict) -> Any:
        out = {k: (v if k in ("enum", "const") else
                   {n: self.node(s) for n, s in v.items()} if k in ("properties", "patternProperties", "dependentSchemas")
                   and isinstance(v, dict) else self.node(v))
               for k, v in node.items() if k != "$defs"}
        siblings = {k: v for k, v in out.items() if k not in (*_GROUPS, "allOf")}
        for group in _GROUPS:
            branches = out.get(group)
            if not isinstance(branches, list) or not (siblings or out.get("allOf")) \
                    or not any(_ref_name(b) for b in branches):
                continue
            if set(siblings) == {"type"} and not out.get("allOf"):  # implied by every branch: dropped
                allowed = types_of({"type": siblings["type"]}, self.resolve)
                if all(types_of(b, self.resolve) <= allowed for b in branches):
                    out.pop("type")
                    siblings = {}
                    continue
            parts = [siblings, *(out.get("allOf") or []), *({g: out[g]} for g in _GROUPS if g != group and g in out)]
            if self.widened is not None:  # the references keep their own schema only
                self.widened.append(f"{_names(branches)}: the keywords beside the anyOf are not applied to them "
                                    "(llguidance cannot intersect recursive references)")
                return {group: [b if _ref_name(b) in self.defs else {"allOf": [b, *parts]} for b in branches]}
            out = {group: [self.lifted(n, parts) if (n := _ref_name(b)) in self.defs else {"allOf": [b, *parts]}
                           for b in branches]}
            return out
        members = out.get("allOf")
        if isinstance(members, list) and any(_ref_name(m) in self.defs for m in members) and len(members) + len(siblings) > 1:
            refs = [m for m in members if _ref_name(m) in self.defs]
            others = [m for m in members if m not in refs] + ([siblings] if siblings else [])
            rest = {k: v for k, v in out.items() if k in _GROUPS}
            first, *more = [_ref_name(m) or "" for m in refs]
            if self.widened is not None:
                self.widened.append(f"{_names(refs)}: the other allOf members beside them are not applied "
                                    "(llguidance cannot intersect recursive references)")
                keep = {"$ref": f"#/$defs/{first}"}
                return {**rest, "allOf": [keep]} if rest else keep
            lifted = self.lifted(first, [*(self.defs[m] for m in more), *others])
            return {**rest, "allOf": [lifted]} if rest else lifted
        return out

    def run(self, root: dict) -> dict:
        out = self.node(root)
        done: dict[str, Any] = {}
        while len(done) < len(self.defs):  # new definitions appear while lifting: lift them too
            for name in [n for n in self.defs if n not in done]:
                done[name] = self.node(self.defs[name])
        return {**out, "$defs": done} if done else out


def _names(nodes: list) -> str:
    return ", ".join(sorted({f"$ref {_ref_name(n)}" for n in nodes if _ref_name(n)}))[:200]


def lift_refs(schema: Any, widened: list | None = None) -> Any:
    """``schema`` (normalised, references into ``$defs``) without intersections of references
    (exact; see the module docstring). Unchanged when it has no ``$defs``.

    ``widened``: a list: instead of new definitions, a reference keeps its own schema only and
    what it would be intersected with is dropped there (a WIDER schema: outputs must be validated;
    the list gets a note per place), for when the exact lifting still leaves llguidance a cycle."""
    if not isinstance(schema, dict) or not isinstance(schema.get("$defs"), dict):
        return schema
    return _Lifter(schema, widened).run(schema)
