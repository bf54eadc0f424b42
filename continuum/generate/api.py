"""The generator constructors: ``text``, ``choice``, ``regex`` and ``json``."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..errors import GeneratorArgumentError, InvalidRegexError, UnsupportedSchemaError
from ..guides import choice_regex, regex_guide, schema_to_regex
from ..samplers import Sampler
from .generator import ChoiceGenerator, Generator

__all__ = ["text", "choice", "regex", "json"]


def _check_model(model) -> None:
    if not hasattr(model, "tokenizer") or not hasattr(model, "forward"):
        raise GeneratorArgumentError(
            f"expected a continuum model (models.transformers(...) or models.Transformers(hf_model, hf_tokenizer)), "
            f"got {type(model).__name__}")


def text(model, sampler: Optional[Sampler] = None, *, token_healing: bool = False) -> Generator:
    """Free text. Returns the continuation only (not the prompt).

    ``token_healing`` (every generator has it, default off): when the input ends inside what would
    be one token (``"https:"`` before ``"//"``), back up its last token and make the first generated
    token start with the removed text (see :mod:`continuum.healing`). The output still starts after
    the input's text.

    Example:
        >>> gen = text(model, samplers.greedy())              # doctest: +SKIP
        >>> gen("Once upon a time", max_tokens=10)            # doctest: +SKIP
        ' there was a little girl named Lily.'
    """
    _check_model(model)
    return Generator(model, sampler, kind="text", token_healing=token_healing)


def regex(model, pattern: str, sampler: Optional[Sampler] = None, *, fast_forward: bool = True,
          token_healing: bool = False) -> Generator:
    """Text matching ``pattern`` (outlines-core regex syntax); invalid patterns raise ``InvalidRegexError``.

    ``fast_forward`` (default on): tokens the pattern forces are appended as one run and computed in
    one forward pass (their log-probs are in the weights; ``max_tokens`` counts them).
    ``token_healing``: see :func:`text`; the pattern applies to the output (after the input's text).

    Example:
        >>> regex(model, r"[0-9]{3}-[a-z]+")("Code: ", max_tokens=12)  # doctest: +SKIP
        '042-ab'
    """
    _check_model(model)
    if not isinstance(pattern, str):
        raise GeneratorArgumentError(f"regex takes a pattern string, got {type(pattern).__name__}")
    return Generator(model, sampler, regex_guide(pattern, model.tokenizer), kind="regex", description=repr(pattern),
                     fast_forward=fast_forward, token_healing=token_healing)


def choice(model, choices: Sequence[str], sampler: Optional[Sampler] = None, *, method: str = "exact",
           fast_forward: bool = True, token_healing: bool = False) -> Generator:
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
        fast_forward: with ``method="greedy"``, the tail of an option the prefix already decides is
            appended as one run and computed in one forward pass (default on).
        token_healing: back up the input's last token; each option is scored as the removed text
            followed by the option, re-tokenized (``"exact"``/``"mean"``), or generated with a healed
            first token (``"greedy"``). See :func:`text`.

    Empty lists raise ``EmptyChoicesError``.

    Example:
        >>> choice(model, ["Positive", "Negative"])("Review: great!\nSentiment: ")  # doctest: +SKIP
        'Positive'
    """
    _check_model(model)
    pattern = choice_regex(choices)
    if method == "greedy":
        return Generator(model, sampler, regex_guide(pattern, model.tokenizer), kind="choice",
                         description=repr(list(choices)), fast_forward=fast_forward, token_healing=token_healing)
    if method not in ("exact", "mean"):
        raise GeneratorArgumentError(f"choice method must be 'exact', 'mean' or 'greedy', got {method!r}")
    return ChoiceGenerator(model, list(choices), sampler, method=method, token_healing=token_healing)


def json(model, schema: Any, sampler: Optional[Sampler] = None, *, whitespace_pattern: Optional[str] = r"[ ]?",
         fast_forward: bool = True, token_healing: bool = False) -> Generator:
    """JSON following ``schema``: a pydantic model class (returns instances), a JSON schema dict or string (returns dicts).

    The schema is compiled to a regex by outlines-core (``build_regex_from_schema``);
    unsupported schemas raise ``UnsupportedSchemaError`` here, not during decoding.
    ``whitespace_pattern`` bounds the whitespace allowed between tokens (default: one optional space;
    ``""`` for compact JSON, where keys and punctuation are forced). ``fast_forward`` (default on):
    forced tokens are appended as one run and computed in one forward pass. ``token_healing``: see
    :func:`text`.

    Example:
        >>> class User(BaseModel):
        ...     name: str
        ...     age: int
        >>> json(model, User)("A user: ", max_tokens=40)   # doctest: +SKIP
        User(name='Ann', age=31)
    """
    _check_model(model)
    pattern, parse = schema_to_regex(schema, whitespace_pattern)
    name = getattr(schema, "__name__", "schema")
    try:
        guide = regex_guide(pattern, model.tokenizer)
    except InvalidRegexError as exc:  # the schema compiled to a regex outlines-core cannot index
        raise UnsupportedSchemaError(f"this JSON schema cannot be compiled for the tokenizer: {exc}") from exc
    return Generator(model, sampler, guide, kind="json", parse=parse, description=name, fast_forward=fast_forward,
                     token_healing=token_healing)
