"""The logic keywords of a JSON schema (``allOf``, ``anyOf``, ``oneOf``, ``not``, ``if``/``then``/``else``,
``dependencies``), normalised into conjuncts of the node (:mod:`.normalize`'s ``_Normalizer.norm`` hands them here):
rewritten exactly where :mod:`.rewrites` can, else widened and named (``n.widen``), never silently."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedSchemaError
from . import rewrites as rw

__all__ = ["COMBINATORS", "combinator"]

COMBINATORS = frozenset({"allOf", "anyOf", "oneOf", "not", "if", "dependencies"})


def combinator(n: Any, key: str, value: Any, node: dict, path: str, extra: list) -> None:
    """Normalise ``node[key]`` (a logic keyword) with the normaliser ``n``; its conjuncts go to ``extra``."""
    here = f"{path}/{key}"
    if key == "allOf" and isinstance(value, list) and not n.relax and (cased := rw.switch(value)):
        prop, cases, others = cased
        n.note(path, "allOf", f"its if/then cases on {prop!r} are generated as cases: only with {prop!r} set "
                  "to a value a case names")
        extra.append({"anyOf": [rw.all_of([{"type": "object", "required": [prop], "properties": {prop: {"enum": vals}}},
                                           n.norm(then, f"{here}/then")]) for vals, then in cases]})
        extra.extend(n.norm(v, f"{here}/{i}") for i, v in enumerate(others))
    elif key in ("allOf", "anyOf", "oneOf"):
        normed = [n.exact(v, f"{here}/{i}") for i, v in enumerate(value)]
        subs = [sub for sub, _ in normed]
        if key == "allOf":
            extra.extend(subs)
        elif key == "anyOf":
            extra.append(rw.any_of(subs))
        else:
            try:
                if not all(ok for _, ok in normed):  # a branch widened or narrowed: cannot exclude it
                    raise rw.refuse(path, "oneOf", "a branch is not enforced exactly", "")
                extra.append(rw.one_of(subs, path, n.resolve, n.note))
            except UnsupportedSchemaError as exc:
                extra.append(n.widen(exc, {"anyOf": subs}, "generated as anyOf: a value may match "
                                        "several branches"))
    elif key == "not":
        try:
            sub, ok = n.exact(value, here)
            if not ok:  # the negation of a widened schema is narrower than the original: unsound
                raise rw.refuse(path, "not", "its schema is not enforced exactly, so neither is its negation",
                                "Rewrite the condition positively")
            extra.append(rw.not_(sub, path, n.resolve))
        except UnsupportedSchemaError as exc:
            n.widen(exc, None, "dropped: values it excludes may be generated")
    elif key == "if" and ("then" in node or "else" in node):
        cond, ok = n.exact(node["if"], f"{path}/if")
        parts = [cond, *(n.norm(node[k], f"{path}/{k}") if k in node else None for k in ("then", "else"))]
        try:
            if not ok:
                raise rw.refuse(path, "if", "`if` is not enforced exactly", "")
            extra.append(rw.if_then_else(parts[0], parts[1], parts[2], path, n.resolve, n.note))
        except UnsupportedSchemaError as exc:
            cond, then, other = (p if p is not None else {} for p in parts)
            if ok:  # relax: (if and then) or else, wider than the original
                n.relaxed(path, "if", "generated as (if and then) or else: a value failing `if` may be "
                             "generated under `then` alone")
                extra.append(rw.any_of([rw.all_of([cond, then]), other]))
            else:  # `if` itself approximated: then or else, wider than the original
                extra.append(n.widen(exc, rw.any_of([then, other]), "generated as then or else"))
    elif key == "dependencies" and isinstance(value, dict):
        lists = {k: v for k, v in value.items() if isinstance(v, list)}
        extra.extend(rw.dependent_required(lists))
        schemas = {k: n.norm(v, f"{here}/{k}") for k, v in value.items() if not isinstance(v, list)}
        extra.extend(rw.dependent_schemas(schemas))
