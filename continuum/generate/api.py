"""The generator constructors: ``text``, ``choice``, ``regex`` and ``json``."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..errors import GeneratorArgumentError, InvalidRegexError, UnsupportedSchemaError
from ..guides import choice_regex, outlines_regex, prepare_json_schema, regex_guide
from ..samplers import Sampler
from .generator import ChoiceGenerator, Generator

__all__ = ["text", "choice", "regex", "json"]


def _check_model(model) -> None:
    if not hasattr(model, "tokenizer") or not hasattr(model, "forward"):
        raise GeneratorArgumentError(
            f"expected a continuum model (models.transformers(...) or models.Transformers(hf_model, hf_tokenizer)), "
            f"got {type(model).__name__}")


def text(model, sampler: Optional[Sampler] = None) -> Generator:
    """Free text. Returns the continuation only (not the prompt).

    Example:
        >>> gen = text(model, samplers.greedy())              # doctest: +SKIP
        >>> gen("Once upon a time", max_tokens=10)            # doctest: +SKIP
        ' there was a little girl named Lily.'
    """
    _check_model(model)
    return Generator(model, sampler, kind="text")


def regex(model, pattern: str, sampler: Optional[Sampler] = None) -> Generator:
    """Text matching ``pattern`` (outlines-core regex syntax); invalid patterns raise ``InvalidRegexError``.

    Example:
        >>> regex(model, r"[0-9]{3}-[a-z]+")("Code: ", max_tokens=12)  # doctest: +SKIP
        '042-ab'
    """
    _check_model(model)
    if not isinstance(pattern, str):
        raise GeneratorArgumentError(f"regex takes a pattern string, got {type(pattern).__name__}")
    return Generator(model, sampler, regex_guide(pattern, model.tokenizer), kind="regex", description=repr(pattern))


def choice(model, choices: Sequence[str], sampler: Optional[Sampler] = None, *, method: str = "exact") -> Generator:
    """One of ``choices``.

    Args:
        choices: the options (non-empty strings), matched as text appended to the prompt, so
            ``" yes"`` and ``"yes"`` differ.
        sampler: greedy -> the best option; ``multinomial(n)`` -> n draws from the options'
            distribution; ``beam_search(n)`` -> the n best (row, option) pairs, best first.
        method: ``"exact"`` (default) scores each option by the total log-prob of its tokens, all
            options in ONE forward pass; an option that is a prefix of another scores at least as
            high (there is no end-of-option term). ``"mean"`` uses the mean log-prob per token
            instead. ``"greedy"`` decodes token by token under the regex ``(opt1|opt2|...)``
            (an outlines-core index), which is cheaper for many long options.

    Empty lists raise ``EmptyChoicesError``.

    Example:
        >>> choice(model, ["Positive", "Negative"])("Review: great!\nSentiment: ")  # doctest: +SKIP
        'Positive'
    """
    _check_model(model)
    pattern = choice_regex(choices)
    if method == "greedy":
        return Generator(model, sampler, regex_guide(pattern, model.tokenizer), kind="choice",
                         description=repr(list(choices)))
    if method not in ("exact", "mean"):
        raise GeneratorArgumentError(f"choice method must be 'exact', 'mean' or 'greedy', got {method!r}")
    return ChoiceGenerator(model, list(choices), sampler, method=method)


def json(model, schema: Any, sampler: Optional[Sampler] = None, *, whitespace_pattern: Optional[str] = r"[ ]?",
         max_string_length: Optional[int] = None) -> Generator:
    """JSON following ``schema``: a pydantic model class (returns instances), a JSON schema dict or string (returns dicts).

    The schema is normalised (``prepare_json_schema``: references inlined, keywords the engines do
    not enforce rewritten exactly or narrowed soundly, with a ``SchemaCoverageWarning``) and then
    compiled to a regex by outlines-core. Schemas no engine can enforce raise
    ``UnsupportedSchemaError`` here (naming the keyword and its JSON path), not during decoding.
    Every output of a dict/string schema is validated with ``jsonschema`` against the original
    schema before it is returned: one that fails raises ``SchemaViolationError`` (naming the row,
    the path and the rule); pydantic outputs are validated by pydantic.

    Args:
        whitespace_pattern: the whitespace allowed between tokens (default: one optional space).
        max_string_length: bounds every string without ``maxLength`` (and without format, pattern or
            enum) to this many characters, so small models terminate; None (default) leaves them unbounded.

    Example:
        >>> class User(BaseModel):
        ...     name: str
        ...     age: int
        >>> json(model, User)("A user: ", max_tokens=40)   # doctest: +SKIP
        User(name='Ann', age=31)
        >>> json(model, {"type": "object", "properties": {"tag": {"type": "string"}}},
        ...      max_string_length=8)("Tag: ", max_tokens=40)   # doctest: +SKIP
        {'tag': 'blue'}
    """
    _check_model(model)
    prepared = prepare_json_schema(schema, max_string_length=max_string_length)
    pattern = outlines_regex(prepared.schema, whitespace_pattern)
    try:
        guide = regex_guide(pattern, model.tokenizer)
    except InvalidRegexError as exc:  # the schema compiled to a regex outlines-core cannot index
        raise UnsupportedSchemaError(f"this JSON schema cannot be compiled for the tokenizer: {exc}") from exc
    return Generator(model, sampler, guide, kind="json", parse=prepared.parse, description=prepared.name)
