"""Constraints: regex, choice and JSON compiled to outlines-core indexes, and vectorised masks.

outlines-core does the real work (regex -> token-level automaton over the vocabulary;
JSON schema -> regex). This module caches compiled indexes per (pattern, tokenizer), turns a
guide state into the tensor of allowed token ids (memoised per state), and builds the additive
logits mask of a whole batch with one ``index_put``.
"""

from __future__ import annotations

import json as _json
import threading
import warnings
from typing import Any, Sequence

import torch

from .errors import EmptyChoicesError, InvalidRegexError, UnsupportedSchemaError

__all__ = ["Guide", "regex_guide", "choice_regex", "schema_to_regex", "escape", "SchemaCoverageWarning"]

# Keywords outlines-core 0.2 accepts but does not enforce in the regex (checked against 0.2.14;
# upstream issues dottxt-ai/outlines-core#147 and #261).
_UNENFORCED = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
               "patternProperties", "contains", "minProperties", "maxProperties", "dependentRequired"}
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
                "$schema", "$id", "id"}
# "Any JSON value", spelled so outlines-core groups it (see _prepare_schema).
_ANY_VALUE = {"anyOf": [{"type": t} for t in ("string", "number", "boolean", "null", "array", "object")]}
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "propertyNames")


class SchemaCoverageWarning(UserWarning):
    """The schema uses keywords the regex compiler ignores: outputs may violate them."""


def _group_pattern(pattern: str) -> str:
    """``pattern`` without its ``^``/``$`` anchors, in a group: outlines-core pastes it between two
    quotes as is, so a top-level ``a|b`` would bind across them (outlines-core#267)."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$"):
        body = pattern[:-1]
        if (len(body) - len(body.rstrip("\\"))) % 2 == 0:  # an even run of backslashes: `$` is an anchor
            pattern = body
    return "(" + pattern + ")"


def _prepare_schema(node: Any, ignored: set[str]) -> Any:
    """A copy of schema ``node`` that outlines-core 0.2 compiles correctly; collects in ``ignored``
    what it will not enforce.

    Work-arounds: a schema without constraints (``{}``, ``true``, annotations only) compiles to an
    ungrouped alternation that lets the whole document be a bare value (outlines-core#151), so it
    becomes an explicit ``anyOf`` of every type; ``pattern`` gets grouped (see ``_group_pattern``).
    """
    if node is True:
        return dict(_ANY_VALUE)
    if not isinstance(node, dict):
        return node
    if set(node) <= _ANNOTATIONS:
        return {**node, **_ANY_VALUE}
    out = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _prepare_schema(v, ignored) for k, v in value.items()}
        elif (key in _SCHEMA_LISTS or key in _SCHEMA_ONE) and isinstance(value, list):  # also draft-4 tuple `items`
            out[key] = [_prepare_schema(v, ignored) for v in value]
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            out[key] = _prepare_schema(value, ignored)
        elif key == "pattern" and isinstance(value, str):
            out[key] = _group_pattern(value)
        else:
            out[key] = value
        if key in _UNENFORCED:
            ignored.add(key)
    if "pattern" in node and ("minLength" in node or "maxLength" in node):
        ignored.add("pattern together with minLength/maxLength (only the length is enforced)")
    if "properties" in node:
        ignored.update(f"{k} beside properties" for k in ("allOf", "anyOf", "oneOf") if k in node)
    return out

# Characters with a meaning in outlines-core's (Rust) regex syntax.
_META = set("\\.+*?()|[]{}^$#&-~")
_LOCK = threading.Lock()


def escape(text: str) -> str:
    """Escape ``text`` for outlines-core's regex syntax (Python's ``re.escape`` escapes more)."""
    return "".join("\\" + c if c in _META else c for c in text)


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of ``choices``."""
    if isinstance(choices, str):
        raise EmptyChoicesError("generate.choice takes a list of options, not a single string")
    options = list(choices)
    if not options:
        raise EmptyChoicesError("generate.choice needs at least one option, e.g. ['yes', 'no']")
    bad = [o for o in options if not isinstance(o, str) or o == ""]
    if bad:
        raise EmptyChoicesError(f"choice options must be non-empty strings; got {bad!r}")
    return "(" + "|".join(escape(o) for o in options) + ")"


def schema_to_regex(schema: Any, whitespace_pattern: str | None = r"[ ]?") -> tuple[str, Any]:
    """(regex, parser) for a pydantic model class, a JSON schema dict or a JSON schema string."""
    from outlines_core.json_schema import build_regex_from_schema
    from pydantic import BaseModel

    if isinstance(schema, type) and issubclass(schema, BaseModel):
        schema_str = _json.dumps(schema.model_json_schema())
        parse = schema.model_validate_json
    else:
        if isinstance(schema, dict):
            schema_str = _json.dumps(schema)
        elif isinstance(schema, str):
            try:
                _json.loads(schema)
            except ValueError as exc:
                raise UnsupportedSchemaError(f"the JSON schema string is not valid JSON: {exc}") from exc
            schema_str = schema
        else:
            raise UnsupportedSchemaError(
                f"generate.json takes a pydantic model class, a JSON schema dict or a JSON string, not {type(schema).__name__}"
            )
        parse = _json.loads
    ignored: set[str] = set()
    prepared = _prepare_schema(_json.loads(schema_str), ignored)
    try:
        regex = build_regex_from_schema(_json.dumps(prepared), whitespace_pattern)
    except Exception as exc:  # outlines-core raises ValueError/TypeError/pyo3 errors
        raise UnsupportedSchemaError(f"cannot compile this JSON schema to a regex: {exc}") from exc
    if ignored:
        warnings.warn(f"the JSON schema uses {sorted(ignored)}, which constrained decoding does not enforce: "
                      "outputs follow the rest of the schema but may violate these (validate them after parsing)",
                      SchemaCoverageWarning, stacklevel=3)
    return regex, parse


class Guide:
    """A compiled constraint: an outlines-core ``Index`` plus memoised per-state allowed ids.

    Guide states are plain ints (outlines-core automaton states), so per-row guide state in the
    decoding loop is a list of ints that reorders like any other per-row state.

    Example:
        >>> guide = regex_guide(r"[0-9]{3}", model.tokenizer)   # doctest: +SKIP
        >>> s = guide.initial_state; ids = guide.allowed(s)      # doctest: +SKIP
    """

    def __init__(self, regex: str, index: Any, eos_token_id: int):
        self.regex = regex
        self.index = index
        self.eos_token_id = eos_token_id
        self.initial_state: int = index.get_initial_state()
        self._allowed: dict[int, torch.Tensor] = {}
        self._final = set(index.get_final_states())

    def __repr__(self) -> str:
        return f"Guide({self.regex[:60]!r})"

    def allowed(self, state: int) -> torch.Tensor:
        ids = self._allowed.get(state)
        if ids is None:
            ids = torch.tensor(self.index.get_allowed_tokens(state) or [], dtype=torch.long)
            self._allowed[state] = ids
        return ids

    def is_final(self, state: int) -> bool:
        return state in self._final

    def is_done(self, state: int) -> bool:
        """Final and nothing but EOS allowed: the row ends here without sampling."""
        if state not in self._final:
            return False
        ids = self.allowed(state)
        return ids.numel() == 0 or bool((ids == self.eos_token_id).all())

    def advance(self, state: int, token_id: int) -> int | None:
        return self.index.get_next_state(state, token_id)


def regex_guide(regex: str, tokenizer) -> Guide:
    """Compile ``regex`` for ``tokenizer`` (cached per tokenizer: the second call is instant)."""
    from outlines_core import Index

    with _LOCK:
        guide = tokenizer.index_cache.get(regex)
    if guide is not None:
        return guide
    try:
        index = Index(regex, tokenizer.vocabulary)
    except Exception as exc:
        raise InvalidRegexError(f"cannot compile regex {regex[:200]!r} for this tokenizer: {exc}") from exc
    guide = Guide(regex, index, tokenizer.eos_token_id)
    with _LOCK:
        tokenizer.index_cache[regex] = guide
    return guide


def build_mask(guide: Guide, states: Sequence[int | None], vocab_size: int, device) -> torch.Tensor:
    """Additive mask ``(rows, vocab)``: 0 where allowed, -inf elsewhere; ``None`` states are free rows."""
    mask = torch.full((len(states), vocab_size), float("-inf"), device=device)
    rows, cols = [], []
    for r, s in enumerate(states):
        if s is None:
            mask[r] = 0.0
            continue
        ids = guide.allowed(s)
        rows.append(torch.full_like(ids, r))
        cols.append(ids)
    if rows:
        mask.index_put_((torch.cat(rows).to(device), torch.cat(cols).to(device)), torch.zeros((), device=device))
    return mask
