"""Compiling a constraint for a tokenizer with the chosen engine: the one place the generators
(``continuum.generate``) and the HF processors (``continuum.processors``) get their guides from.

* :func:`regex_for`: outlines-core (``"auto"``/``"outlines"``) or llguidance's regex;
* :func:`json_for`: the normalised schema (:func:`~continuum.guides.prepare.prepare_json_schema`)
  enforced by llguidance (``"auto"``/``"llguidance"``) or outlines-core;
* :func:`grammar_for`: a Lark (or GBNF) grammar, llguidance only.
"""

from __future__ import annotations

import json
import re
import threading
import warnings
import weakref
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from ..errors import GeneratorArgumentError, InvalidGrammarError, InvalidRegexError, UnsupportedSchemaError
from ..models.tokenizer import check_encodable
from .base import Guide, check_backend
from .bounds import resolve_bounds
from .closing import close_objects
from .limits import compile_limits
from .llguidance import GrammarCompileError, json_grammar, lark_grammar, llguidance_guide, regex_grammar
from .outlines import regex_guide
from .overlaps import merge_patterns, split_overlaps
from .prepare import PreparedSchema, coverage_message, prepare_json_schema
from .refs import lift_refs
from .regex_size import estimate_regex
from .schema import SchemaCoverageWarning, outlines_regex_ignored

__all__ = ["regex_for", "json_for", "grammar_for"]


def _too_large_for_outlines(tokenizer, pattern: str) -> str | None:
    """Why an outlines-core index of ``pattern`` would blow the compile budget, or None (see ``limits``)."""
    if pattern in tokenizer.index_cache:
        return None
    size = estimate_regex(pattern)
    vocab = len(tokenizer)
    limit = compile_limits().outlines_max_work
    if size.cost(vocab) <= limit:
        return None
    states = f"~{size.states:.3g}" if size.states < 1e15 else "astronomically many"
    return (f"its outlines-core index would have {states} automaton states over a vocabulary of {vocab} tokens "
            f"(estimated work {size.cost(vocab):.2g} > limit {limit:.2g}, i.e. several seconds or more to build)")


def regex_for(tokenizer, pattern: str, backend: str = "auto") -> Guide:
    """The guide of ``pattern`` (raises ``InvalidRegexError``).

    ``"auto"`` builds an outlines-core index unless its estimated cost is over the compile budget
    (:mod:`continuum.guides.limits`), in which case llguidance compiles it lazily instead.
    """
    if not isinstance(pattern, str):
        raise InvalidRegexError(f"a regex must be a str, got {type(pattern).__name__}")
    check_encodable(pattern, "the regex")
    backend = check_backend(backend)
    if backend in ("auto", "outlines"):
        why = _too_large_for_outlines(tokenizer, pattern)
        if why is None:
            return regex_guide(pattern, tokenizer)
        if backend == "outlines":
            raise InvalidRegexError(
                f"the regex {pattern[:100]!r} is too large for outlines-core: {why}. Use backend='llguidance' "
                f"(it compiles lazily), or smaller repetition bounds (e.g. {{1,100}} instead of {{1,100000}}); "
                f"continuum.guides.limits.set_compile_limits(outlines_max_work=...) raises the budget")
    try:
        return llguidance_guide(regex_grammar(pattern), tokenizer)
    except GrammarCompileError as exc:
        raise InvalidRegexError(f"llguidance cannot compile regex {pattern[:200]!r}: {exc}") from exc


_LIMIT_WORDS = ("limit", "fuel", "too large", "too big", "too many", "exceeded")


_JSON_CACHE_SIZE = 64  # compiled JSON guides kept per tokenizer, least recently used out (a server's response formats)
_JSON_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_JSON_LOCK = threading.Lock()


def _json_key(schema: Any, options: dict) -> tuple | None:
    """What identifies a compiled JSON guide: the schema (a pydantic class by identity, JSON by its canonical text)
    and every option; None where the schema cannot be keyed (then nothing is cached)."""
    try:
        spec = ("class", schema) if isinstance(schema, type) else ("json", json.dumps(schema, sort_keys=True))
        return spec + tuple(sorted((k, repr(v)) for k, v in options.items()))
    except (TypeError, ValueError, RecursionError):  # (not JSON, or nested too deep: the compile step says so)
        return None


def json_for(tokenizer, schema: Any, **options: Any) -> tuple[Guide, PreparedSchema]:
    """(guide, prepared schema) of a pydantic model class or JSON schema, cached per tokenizer by schema and options
    (bounded, least recently used out: a repeated response format costs nothing to prepare); see :func:`_json_for`.
    A cached result warns as the first one did (the same coverage warning)."""
    key = _json_key(schema, options)
    if key is not None:
        with _JSON_LOCK:
            cache = _JSON_CACHES.setdefault(tokenizer, OrderedDict())
            hit = cache.get(key)
            if hit is not None:
                cache.move_to_end(key)
        if hit is not None:
            message = coverage_message(hit[1].narrowed, hit[1].approximated, hit[1].engine_ignored)
            if message:
                warnings.warn(message, SchemaCoverageWarning, stacklevel=4)  # (where the first one pointed)
            return hit
    guide, prepared = _json_for(tokenizer, schema, **options)
    if key is not None:
        with _JSON_LOCK:
            cache[key] = (guide, prepared)
            while len(cache) > _JSON_CACHE_SIZE:
                cache.popitem(last=False)
    return guide, prepared


def _json_for(tokenizer, schema: Any, *, whitespace_pattern: str | None = r"[ ]?", backend: str = "auto",
             max_string_length: int | None = None, additional_properties: bool = False,
             on_unsupported: str = "approximate", max_items: int | None = None,
             bounds: Any = "default") -> tuple[Guide, PreparedSchema]:
    """(guide, prepared schema) of a pydantic model class or JSON schema (raises ``UnsupportedSchemaError``).

    ``bounds`` (default ``"default"``: numbers within int64, fractions of 10 digits) bounds what the
    schema leaves unbounded (:mod:`continuum.guides.bounds`); ``max_string_length``/``max_items`` override it.

    Emits ONE :class:`SchemaCoverageWarning` listing what is not enforced exactly (normaliser and
    engine together); ``prepared.exact`` says whether every keyword is enforced.
    """
    check_backend(backend)
    limits = resolve_bounds(bounds, max_string_length, max_items)
    prepared = prepare_json_schema(schema, bounds=limits, warn=False, additional_properties=additional_properties,
                                   on_unsupported=on_unsupported)
    approximate = on_unsupported == "approximate"
    if backend == "outlines":
        try:
            regex, ignored = outlines_regex_ignored(prepared.schema, whitespace_pattern)
            guide = regex_for(tokenizer, regex, "outlines")
        except InvalidRegexError as exc:  # the schema compiled to a regex outlines-core cannot index
            raise UnsupportedSchemaError(f"this JSON schema cannot be compiled for the tokenizer: {exc}") from exc
        return guide, _done_prepared(prepared, ignored, stacklevel=5)
    try:
        return _llguidance_json(tokenizer, schema, prepared, whitespace_pattern, approximate,
                                dict(bounds=limits, warn=False, additional_properties=additional_properties,
                                     on_unsupported=on_unsupported))
    except UnsupportedSchemaError:
        if not limits.whole_value:
            raise
    # the value-as-a-whole bounds left nothing (a divided bound below a minimum another allOf member sets)
    # or grew the schema past llguidance's limits (a subtree copied per division): per-leaf bounds instead
    return _json_for(tokenizer, schema, whitespace_pattern=whitespace_pattern, backend=backend,
                     additional_properties=additional_properties, on_unsupported=on_unsupported,
                     bounds=replace(limits, whole_value=False))


def _forms(prepared: PreparedSchema, additional_properties: bool, widened: list | None = None,
           widen_refs: bool = False) -> list:
    """The engine schemas of ``prepared``, strictest first: closed objects with bounded keys, unbounded
    keys, then open objects (each sound, only less strict), spelled for llguidance (exact rewrites,
    or with ``widened`` a list, the widening of :func:`~continuum.guides.overlaps.split_overlaps`)."""
    if prepared.schema is False:
        return []
    forms = [prepared.schema]
    if prepared.normalized is not None:
        forms += [close_objects(prepared.normalized.schema, additional_properties=additional_properties),
                  prepared.normalized.schema]
    forms = [lift_refs(split_overlaps(f, widened), widened if widen_refs else None) for f in forms]
    return [f for i, f in enumerate(forms) if f not in forms[:i]]


def _llguidance_json(tokenizer, schema: Any, prepared: PreparedSchema, whitespace_pattern: str | None,
                     approximate: bool, options: dict) -> tuple[Guide, PreparedSchema]:
    """The llguidance guide of ``prepared``: the exact forms first, then (``approximate``) wider ones,
    each named in the coverage warning and validated against the original schema.

    The ladder: exact forms; the same with references kept (``inline=False``: smaller, for llguidance's
    size limits); [approximate only] patternProperties not applied to the declared properties they
    overlap; no narrowing at all (``relax``: when a narrowing left nothing); llguidance's lenient mode
    (keywords it does not implement ignored, patterns it cannot read dropped).
    """
    errors: list[GrammarCompileError] = []
    additional = options["additional_properties"]

    def attempt(p: PreparedSchema, forms: list, lenient: bool = False, notes=()):
        for form in forms:
            try:
                grammar = json_grammar(form, whitespace_pattern, lenient=lenient)
                guide = llguidance_guide(grammar, tokenizer)
            except GrammarCompileError as exc:
                errors.append(exc)
                continue
            if lenient:
                from llguidance import LLMatcher

                warned = LLMatcher.validate_grammar_with_warnings(grammar)[1]
                notes = [f"llguidance: {n}" for n in warned] + list(notes) or [f"llguidance: {errors[-1]}"]
            return guide, _done_prepared(p, notes, stacklevel=7)  # the caller of generate.json
        return None

    found = attempt(prepared, _forms(prepared, additional))
    refs_kept = None
    if found is None and prepared.schema is not False:  # smaller; its recursion may also lift better
        refs_kept = prepare_json_schema(schema, inline=False, **options)
        found = attempt(refs_kept, _forms(refs_kept, additional))
    if found is not None:
        return found
    unsatisfiable = prepared.schema is False or any("unsatisfiable" in str(e).lower() for e in errors)
    if not approximate or not isinstance(prepared.schema, (dict, bool)):
        _refuse(prepared, errors, unsatisfiable, approximate)
    candidates = [p for p in (prepared, refs_kept) if p is not None]
    overlapping = any("not disjoint" in str(e) for e in errors)
    circular = any("circular references" in str(e) for e in errors)
    counted = any("min/maxProperties" in str(e) for e in errors)
    for p in candidates:  # 1. overlapping patternProperties not applied to the declared properties
        widened: list[str] = []
        forms = _forms(p, additional, widened, widen_refs=circular)
        if overlapping:
            forms = [merge_patterns(f, widened) for f in forms]
        if counted:
            forms = [_drop_counts(f, "", widened) for f in forms]
        if widened and (found := attempt(p, forms, notes=sorted(set(widened)))):
            return found
    if unsatisfiable and options["bounds"].whole_value:  # json_for tries per-leaf bounds before relaxing
        _refuse(prepared, errors, True, approximate)
    if unsatisfiable:  # 2. a narrowing may have left nothing: no narrowing, open objects
        relaxed = prepare_json_schema(schema, relax=True, **{**options, "additional_properties": True})
        if relaxed.schema is False:
            _refuse(relaxed, errors, True, approximate)
        candidates.insert(0, relaxed)
        if found := attempt(relaxed, _forms(relaxed, True)):
            return found
    for p in candidates:  # 3. llguidance's lenient mode, without the string patterns it cannot compile
        dropped: list[str] = []
        forms = [_drop_patterns(f, "", dropped) for f in _forms(p, additional, dropped, widen_refs=circular)]
        if overlapping:
            forms = [merge_patterns(f, dropped) for f in forms]
        if found := attempt(p, forms, lenient=True, notes=list(dict.fromkeys(dropped))):
            return found
    _refuse(prepared, errors, False, approximate, lenient=True)
    raise AssertionError("unreachable")


def _limit_hit(errors: list) -> bool:
    return bool(errors) and any(w in str(errors[-1]).lower() for w in _LIMIT_WORDS)


def _refuse(prepared: PreparedSchema, errors: list, unsatisfiable: bool, approximate: bool, lenient: bool = False):
    """Raise the ``UnsupportedSchemaError`` that says why no form compiled."""
    exc = errors[-1] if errors else None
    if unsatisfiable and (approximate or prepared.schema is False):
        raise UnsupportedSchemaError(
            "the JSON schema accepts no value (it is unsatisfiable" + (
                "" if approximate else ", or a narrowing left nothing: on_unsupported='approximate' compiles a wider "
                "schema and validates") + f"){': ' + str(exc) if exc else ''}: nothing can be generated",
            keyword="unsatisfiable") from exc
    if _limit_hit(errors):
        raise UnsupportedSchemaError(
            f"this JSON schema is too large for llguidance's limits ({exc}): raise the engine's limit it names, "
            "or simplify the schema (fewer alternatives, shorter patterns, bounded repetitions)",
            keyword="engine limit") from exc
    if not approximate:
        raise UnsupportedSchemaError(
            f"llguidance cannot enforce this JSON schema: {exc}. Remove or rewrite what it names, pass "
            "on_unsupported='approximate' (what llguidance cannot enforce is dropped, outputs are validated), "
            "or backend='outlines'") from exc
    raise UnsupportedSchemaError(f"llguidance cannot enforce this JSON schema, even leniently: {exc}",
                                 keyword=_reason(str(exc))) from exc


def _reason(message: str) -> str:
    """A short name of why llguidance refused (the refusal's ``keyword``, counted by the benchmark)."""
    low = message.lower()
    for needle, name in (("circular references", "recursion with sibling keys"),
                         ("not disjoint", "overlapping patternProperties"), ("lookaround", "pattern lookaround"),
                         ("regex parse error", "pattern syntax"), ("float range", "number range"),
                         ("unsatisfiable", "unsatisfiable"), ("stack level", "engine limit")):
        if needle in low:
            return name
    return message[:40]


def _drop_counts(node: Any, path: str, dropped: list) -> Any:
    """``node`` without ``minProperties``/``maxProperties`` where llguidance cannot count the keys
    (it does only when every declared property is required): wider, named in ``dropped``."""
    if isinstance(node, list):
        return [_drop_counts(v, f"{path}/{i}", dropped) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("minProperties", "maxProperties") and isinstance(node.get("properties"), dict) \
                and set(node["properties"]) - set(node.get("required", [])):
            dropped.append(f"{path}/{key}: dropped (llguidance counts keys only when every property is required)")
        elif key in ("enum", "const"):
            out[key] = value
        else:
            out[key] = _drop_counts(value, f"{path}/{key}", dropped)
    return out


_LOOKAROUND = re.compile(r"\(\?<?[!=](?:\\.|[^()\\]|\((?:\\.|[^()\\])*\))*\)")


def _drop_patterns(node: Any, path: str, dropped: list) -> Any:
    """``node`` without the string ``pattern``s llguidance cannot compile (look-arounds, syntax it
    does not parse), each named in ``dropped``: a wider schema, so outputs must be (and are) validated."""
    if isinstance(node, list):
        return [_drop_patterns(v, f"{path}/{i}", dropped) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "pattern" and isinstance(value, str) and not _regex_ok(value):
            dropped.append(f"{path}/pattern: dropped (llguidance cannot compile {value[:60]!r})")
            continue
        if key in ("enum", "const"):
            out[key] = value
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {}
            for pattern, sub in value.items():
                if not _regex_ok(pattern):
                    wider = _LOOKAROUND.sub("", pattern)
                    dropped.append(f"{path}/patternProperties: {pattern[:60]!r} " + (
                        f"read as {wider[:60]!r}" if _regex_ok(wider) else "dropped") + " (llguidance cannot compile it)")
                    if not _regex_ok(wider):
                        continue
                    pattern = wider
                out[key][pattern] = _drop_patterns(sub, f"{path}/{key}/{pattern}", dropped)
        elif key in ("properties", "$defs") and isinstance(value, dict):
            out[key] = {k: _drop_patterns(v, f"{path}/{key}/{k}", dropped) for k, v in value.items()}
        else:
            out[key] = _drop_patterns(value, f"{path}/{key}", dropped)
    return out


def _regex_ok(pattern: str) -> bool:
    from llguidance import LLMatcher

    try:
        is_error, _ = LLMatcher.validate_grammar_with_warnings(
            LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern}))
    except Exception:  # noqa: BLE001 - refused while building the grammar
        return False
    return not is_error


def _done_prepared(prepared: PreparedSchema, engine_ignored, stacklevel: int = 4) -> PreparedSchema:
    """``prepared`` with what the engine does not enforce, after its ONE coverage warning."""
    prepared = replace(prepared, engine_ignored=tuple(sorted(map(str, engine_ignored))))
    message = coverage_message(prepared.narrowed, prepared.approximated, prepared.engine_ignored)
    if message:
        warnings.warn(message, SchemaCoverageWarning, stacklevel=stacklevel)
    return prepared


def grammar_for(tokenizer, grammar: str, syntax: str = "lark", backend: str = "auto") -> Guide:
    """The guide of a Lark grammar in llguidance's syntax, or of a GBNF one (raises ``InvalidGrammarError``)."""
    check_backend(backend, ("auto", "llguidance"))
    if not isinstance(grammar, str) or not grammar.strip():
        raise GeneratorArgumentError(f"cfg takes a non-empty grammar string, got {grammar!r:.60}")
    check_encodable(grammar, "the grammar")
    if syntax == "gbnf":
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(grammar)
        except Exception as exc:  # GbnfToLarkError, or a parse failure inside the converter
            raise InvalidGrammarError(f"cannot convert this GBNF grammar to Lark: {exc}") from exc
    elif syntax == "lark":
        lark = grammar
    else:
        raise GeneratorArgumentError(f"syntax must be 'lark' or 'gbnf', got {syntax!r}")
    try:
        return llguidance_guide(lark_grammar(lark), tokenizer)
    except GrammarCompileError as exc:
        raise InvalidGrammarError(f"llguidance cannot compile this {syntax} grammar: {exc}") from exc
