"""The generator constructors: ``text``, ``choice``, ``regex`` and ``json``."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from ..cfg import CFG
from ..errors import GeneratorArgumentError, InvalidChoicesError, InvalidRegexError, UnsupportedSchemaError
from ..guides import choice_regex, regex_guide, schema_to_regex
from ..samplers import Sampler
from .generator import ChoiceGenerator, Generator

__all__ = ["text", "choice", "regex", "json"]

NegativePrompt = Union[str, Sequence[str], None]
_CFG_DOC = """
    Classifier-free guidance (every generator; see docs/generators.md):
        guidance_scale: next-token scores are ``uncond + guidance_scale * (cond - uncond)`` on the
            log-probs of the prompt (cond) and of the negative prompt (uncond); 1 (default) = off,
            nothing extra is run.
        negative_prompt: a string shared by every prompt, or one per prompt; default: BOS alone (or
            the prompt's last token when the tokenizer has no BOS).
        guidance_rescale: blend back ``r * cond + (1 - r) * guided``, in [0, 1].
        cfg_mode: ``"batched"`` (both branches in one forward, 2x rows) or ``"sequential"``
            (two forwards per step, less peak memory). Same results.
"""


def _check_model(model) -> None:
    if not hasattr(model, "tokenizer") or not hasattr(model, "forward"):
        raise GeneratorArgumentError(
            f"expected a continuum model (models.transformers(...) or models.Transformers(hf_model, hf_tokenizer)), "
            f"got {type(model).__name__}")


def text(model, sampler: Optional[Sampler] = None, *, guidance_scale: float = 1.0, negative_prompt: NegativePrompt = None,
         guidance_rescale: float = 0.0, cfg_mode: str = "batched") -> Generator:
    """Free text. Returns the continuation only (not the prompt).

    Example:
        >>> gen = text(model, samplers.greedy())              # doctest: +SKIP
        >>> gen("Once upon a time", max_tokens=10)            # doctest: +SKIP
        ' there was a little girl named Lily.'
    """
    _check_model(model)
    cfg = CFG.make(model.tokenizer, guidance_scale, negative_prompt, guidance_rescale, cfg_mode)
    return Generator(model, sampler, kind="text", cfg=cfg)


def regex(model, pattern: str, sampler: Optional[Sampler] = None, *, guidance_scale: float = 1.0,
          negative_prompt: NegativePrompt = None, guidance_rescale: float = 0.0, cfg_mode: str = "batched") -> Generator:
    """Text matching ``pattern`` (outlines-core regex syntax); invalid patterns raise ``InvalidRegexError``.

    Example:
        >>> regex(model, r"[0-9]{3}-[a-z]+")("Code: ", max_tokens=12)  # doctest: +SKIP
        '042-ab'
    """
    _check_model(model)
    if not isinstance(pattern, str):
        raise GeneratorArgumentError(f"regex takes a pattern string, got {type(pattern).__name__}")
    guide = regex_guide(pattern, model.tokenizer)
    if guide.is_done(guide.initial_state):  # nothing to generate: every call would return ""
        raise InvalidRegexError(f"the regex {pattern!r} matches only the empty string, so it can never produce text: "
                                f"give a pattern that matches non-empty text (e.g. {pattern + '.+'!r})")
    cfg = CFG.make(model.tokenizer, guidance_scale, negative_prompt, guidance_rescale, cfg_mode)
    return Generator(model, sampler, guide, kind="regex", description=repr(pattern), cfg=cfg)


def choice(model, choices: Sequence[str], sampler: Optional[Sampler] = None, *, method: str = "exact",
           guidance_scale: float = 1.0, negative_prompt: NegativePrompt = None, guidance_rescale: float = 0.0,
           cfg_mode: str = "batched") -> Generator:
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
            With guidance, "exact"/"mean" rank the options by their guided token scores (one more
            forward over the options after the negative prompt); weights stay the raw log-probs.

    Empty lists or options raise ``EmptyChoicesError``; duplicated options raise
    ``InvalidChoicesError`` (which of two equal options was chosen would be ambiguous).

    Example:
        >>> choice(model, ["Positive", "Negative"])("Review: great!\nSentiment: ")  # doctest: +SKIP
        'Positive'
    """
    _check_model(model)
    if not isinstance(choices, str):  # (a bare str is refused by choice_regex)
        try:
            choices = list(choices)
        except TypeError:
            raise InvalidChoicesError(f"generate.choice takes a list of option strings, got {type(choices).__name__}") from None
    pattern = choice_regex(choices)
    repeated = sorted({o for o in choices if choices.count(o) > 1})
    if repeated:
        raise InvalidChoicesError(f"generate.choice options must be distinct; {repeated} appear more than once: "
                                  f"remove the duplicates")
    if method not in ("exact", "mean", "greedy"):
        raise GeneratorArgumentError(f"choice method must be 'exact', 'mean' or 'greedy', got {method!r}")
    cfg = CFG.make(model.tokenizer, guidance_scale, negative_prompt, guidance_rescale, cfg_mode)
    if method == "greedy":
        return Generator(model, sampler, regex_guide(pattern, model.tokenizer), kind="choice",
                         description=repr(list(choices)), cfg=cfg)
    return ChoiceGenerator(model, list(choices), sampler, method=method, cfg=cfg)


def json(model, schema: Any, sampler: Optional[Sampler] = None, *, whitespace_pattern: Optional[str] = r"[ ]?",
         guidance_scale: float = 1.0, negative_prompt: NegativePrompt = None, guidance_rescale: float = 0.0,
         cfg_mode: str = "batched") -> Generator:
    """JSON following ``schema``: a pydantic model class (returns instances), a JSON schema dict or string (returns dicts).

    The schema is compiled to a regex by outlines-core (``build_regex_from_schema``);
    unsupported schemas raise ``UnsupportedSchemaError`` here, not during decoding.
    ``whitespace_pattern`` bounds the whitespace allowed between tokens (default: one optional space).

    Example:
        >>> class User(BaseModel):
        ...     name: str
        ...     age: int
        >>> json(model, User)("A user: ", max_tokens=40)   # doctest: +SKIP
        User(name='Ann', age=31)
    """
    _check_model(model)
    cfg = CFG.make(model.tokenizer, guidance_scale, negative_prompt, guidance_rescale, cfg_mode)
    pattern, parse = schema_to_regex(schema, whitespace_pattern)
    name = getattr(schema, "__name__", "schema")
    try:
        guide = regex_guide(pattern, model.tokenizer)
    except InvalidRegexError as exc:  # the schema compiled to a regex outlines-core cannot index
        raise UnsupportedSchemaError(f"this JSON schema cannot be compiled for the tokenizer: {exc}") from exc
    return Generator(model, sampler, guide, kind="json", parse=parse, description=name, cfg=cfg)


for _f in (text, regex, choice, json):
    _f.__doc__ += _CFG_DOC
