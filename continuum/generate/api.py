"""The generator constructors: ``text``, ``choice``, ``regex``, ``json`` and ``cfg``.

Constrained generators take ``backend="auto" | "outlines" | "llguidance"``: the engine that
enforces the constraint (see ``continuum.guides``). ``"auto"`` uses llguidance for JSON Schema and
grammars, outlines-core for regexes and choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import GeneratorArgumentError, InvalidChoicesError, InvalidRegexError
from ..guides import check_backend, choice_regex
from ..guides.compile import grammar_for, json_for, regex_for
from ..loop.cfg import Guidance
from ..samplers import Sampler, greedy
from ..speculate import Speculator
from .generator import ChoiceGenerator, Generator
from .spec import GeneratorSpec, arguments, remember

__all__ = ["text", "choice", "regex", "json", "cfg"]


NegativePrompt = str | Sequence[str] | None
_GUIDANCE_DOC = """
    Every generator also takes:
        token_healing: when the input ends inside what would be one token (``"https:"`` before
            ``"//"``), back up its last token and make the first generated token start with the
            removed text (see :mod:`continuum.loop.healing`); the output still starts after the input's
            text. Default off.
        fast_forward (constrained generators): tokens the constraint forces (JSON keys and
            punctuation, the tail of a choice) are appended as one run and computed in ONE forward
            pass (:mod:`continuum.loop.fastforward`). Default on; not applied with guidance.

    Classifier-free guidance (every generator; see docs/generators.md):
        guidance_scale: next-token scores are ``uncond + guidance_scale * (cond - uncond)`` on the
            log-probs of the prompt (cond) and of the negative prompt (uncond); 1 (default) = off,
            nothing extra is run.
        negative_prompt: a string shared by every prompt, or one per prompt; default: BOS alone (or
            the prompt's last token when the tokenizer has no BOS).
        guidance_rescale: blend back ``r * cond + (1 - r) * guided``, in [0, 1].
        cfg_mode: ``"batched"`` (both branches in one forward, 2x rows) or ``"sequential"``
            (two forwards per step, less peak memory). Same results.

    Reasoning (every generator; see docs/reasoning.md):
        reasoning: False (default); True: the model first writes a free thought between the
            tokenizer's ``<think>``/``</think>`` tokens (no mask: the sampler's own distribution),
            then the constraint applies from the token after the end marker; or the marker pair
            ``("<think>", "</think>")`` for a tokenizer without such tokens. A prompt that already
            closed the thought gets the constraint from token 0. ``state.value`` is the answer,
            ``state.reasoning`` the thought.
        thinking_budget: at most this many thought tokens, then the end marker (and the
            template's newlines) is forced; ``finish_reason`` reads ``"thinking_budget"``.
            ``max_tokens`` counts thought, markers and answer: a budget that leaves the answer
            fewer than 8 tokens raises ``ReasoningError``.

    Speculative decoding (text, regex, json, cfg; see docs/speculation.md):
        speculate: a speculator: ``continuum.speculate.lookup()`` (drafts from the row's own tokens) or
            ``continuum.speculate.draft(small_model)`` (a smaller model of the same vocabulary); drafted
            tokens are verified in each step's one forward and kept where the sampler agrees, under the constraint:
            greedy gives the same tokens, multinomial the same distribution. Not with beam search. Default None.
"""


def _check_model(model) -> None:
    if not hasattr(model, "tokenizer") or not hasattr(model, "forward"):
        raise GeneratorArgumentError(
            f"expected a continuum model (models.transformers(...) or models.Transformers(hf_model, hf_tokenizer)), "
            f"got {type(model).__name__}")


def text(model, sampler: Sampler | None = None, *, token_healing: bool = False, guidance_scale: float = 1.0,
         negative_prompt: NegativePrompt = None,
         guidance_rescale: float = 0.0, cfg_mode: str = "batched", reasoning: Any = False,
         thinking_budget: int | None = None, speculate: Speculator | None = None) -> Generator:
    """Free text. Returns the continuation only (not the prompt).

    Example:
        >>> gen = text(model, samplers.greedy())              # doctest: +SKIP
        >>> gen("Once upon a time", max_tokens=10)            # doctest: +SKIP
        ' there was a little girl named Lily.'
    """
    spec = GeneratorSpec("text", arguments(locals()))  # (what a server rebuilds it from: models.remote)
    _check_model(model)
    return remember(Generator(model, sampler, kind="text",
                     guidance=Guidance.make(model.tokenizer, guidance_scale, negative_prompt, guidance_rescale, cfg_mode),
                     token_healing=token_healing, reasoning=reasoning, thinking_budget=thinking_budget,
                     speculate=speculate), spec)


def regex(model, pattern: str, sampler: Sampler | None = None, *, backend: str = "auto",
          fast_forward: bool = True, token_healing: bool = False, guidance_scale: float = 1.0,
          negative_prompt: NegativePrompt = None,
         guidance_rescale: float = 0.0, cfg_mode: str = "batched", reasoning: Any = False,
         thinking_budget: int | None = None, speculate: Speculator | None = None) -> Generator:
    """Text matching ``pattern``; invalid patterns raise ``InvalidRegexError``.

    ``backend``: ``"auto"``/``"outlines"`` compile the pattern to an outlines-core index (its
    regex syntax); ``"llguidance"`` uses llguidance's regex (Rust ``regex`` syntax), compiled lazily
    while decoding, so large patterns start faster. The size of the outlines-core index is estimated
    first (``continuum.guides.limits``): past the compile budget (a few seconds), ``"auto"`` uses
    llguidance and ``"outlines"`` raises ``InvalidRegexError`` (e.g. ``[a-z]{1000000}``).

    Example:
        >>> regex(model, r"[0-9]{3}-[a-z]+")("Code: ", max_tokens=12)  # doctest: +SKIP
        '042-ab'
    """
    spec = GeneratorSpec("regex", arguments(locals()))
    _check_model(model)
    if not isinstance(pattern, str):
        raise GeneratorArgumentError(f"regex takes a pattern string, got {type(pattern).__name__}")
    guide = regex_for(model.tokenizer, pattern, backend)
    if guide.is_done(guide.new_state()):  # nothing to generate: every call would return ""
        raise InvalidRegexError(f"the regex {pattern!r} matches only the empty string, so it can never produce text: "
                                f"give a pattern that matches non-empty text (e.g. {pattern + '.+'!r})")
    return remember(Generator(model, sampler, guide, kind="regex", description=repr(pattern),
                     guidance=Guidance.make(model.tokenizer, guidance_scale, negative_prompt, guidance_rescale, cfg_mode),
                     fast_forward=fast_forward, token_healing=token_healing, reasoning=reasoning,
                     thinking_budget=thinking_budget, speculate=speculate), spec)


def choice(model, choices: Sequence[str], sampler: Sampler | None = None, *, method: str = "exact",
           backend: str = "auto", fast_forward: bool = True, token_healing: bool = False, guidance_scale: float = 1.0,
           negative_prompt: NegativePrompt = None,
           guidance_rescale: float = 0.0, cfg_mode: str = "batched", reasoning: Any = False,
         thinking_budget: int | None = None) -> Generator:
    """One of ``choices``.

    Args:
        choices: the options (non-empty strings), matched as text appended to the prompt, so
            ``" yes"`` and ``"yes"`` differ.
        sampler: greedy (the default) -> the best option; ``multinomial(n)`` -> n draws from the
            options' distribution; ``beam_search(n)`` -> the n best (row, option) pairs, best first.
            (Unlike the other generators, whose default is ``multinomial()``: a choice is a decision,
            and one left to chance picked a 6% option 1-2 times in 48, a different one each run.)
        method: ``"exact"`` (default) scores each option by the total log-prob of its tokens, all
            options in ONE forward pass; an option that is a prefix of another scores at least as
            high (there is no end-of-option term). ``"mean"`` uses the mean log-prob per token
            instead. ``"greedy"`` decodes token by token under the regex ``(opt1|opt2|...)``,
            which is cheaper for many long options.
        backend: the engine of ``method="greedy"``: ``"auto"``/``"outlines"`` (an outlines-core
            index) or ``"llguidance"``; the scoring methods use no engine.
            With token healing, "exact"/"mean" score each option as the removed text followed by
            the option, re-tokenized; "greedy" generates with a healed first token.
            With guidance, "exact"/"mean" rank the options by their guided token scores (one more
            forward over the options after the negative prompt); weights stay the raw log-probs.

    Empty lists or options raise ``EmptyChoicesError``; duplicated options raise
    ``InvalidChoicesError`` (which of two equal options was chosen would be ambiguous).

    Example:
        >>> choice(model, ["Positive", "Negative"])("Review: great!\nSentiment: ")  # doctest: +SKIP
        'Positive'
    """
    spec = GeneratorSpec("choice", arguments(locals()))
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
    check_backend(backend)
    if method not in ("exact", "mean", "greedy"):
        raise GeneratorArgumentError(f"choice method must be 'exact', 'mean' or 'greedy', got {method!r}")
    guidance = Guidance.make(model.tokenizer, guidance_scale, negative_prompt, guidance_rescale, cfg_mode)
    sampler = greedy() if sampler is None else sampler  # the best option, like guidance's select and SGLang's
    if method == "greedy":
        return remember(Generator(model, sampler, regex_for(model.tokenizer, pattern, backend), kind="choice",
                         description=repr(list(choices)), guidance=guidance, fast_forward=fast_forward,
                         token_healing=token_healing, reasoning=reasoning, thinking_budget=thinking_budget), spec)
    return remember(ChoiceGenerator(model, list(choices), sampler, method=method, guidance=guidance,
                                    token_healing=token_healing, reasoning=reasoning, thinking_budget=thinking_budget), spec)


def json(model, schema: Any, sampler: Sampler | None = None, *, whitespace_pattern: str | None = r"[ ]?",
         backend: str = "auto", max_string_length: int | None = None, additional_properties: bool = False,
         on_unsupported: str = "approximate", max_items: int | None = None, bounds: Any = "default",
         fast_forward: bool = True,
         token_healing: bool = False, guidance_scale: float = 1.0, negative_prompt: NegativePrompt = None,
         guidance_rescale: float = 0.0, cfg_mode: str = "batched", reasoning: Any = False,
         thinking_budget: int | None = None, speculate: Speculator | None = None) -> Generator:
    """JSON following ``schema``: a pydantic model class (returns instances), a JSON schema dict or string (returns dicts).

    The schema is normalised first (``prepare_json_schema``: references inlined, keywords the
    engines do not enforce rewritten exactly or narrowed soundly); what is not enforced exactly is
    named in ONE ``SchemaCoverageWarning`` at creation. Every output of a dict/string schema is
    validated with ``jsonschema`` against the ORIGINAL schema before it is returned: one that fails
    raises ``SchemaViolationError`` (naming the row, the path and the rule); pydantic outputs are
    validated by pydantic. So no invalid value is ever returned silently.

    The generator's ``exact`` attribute is True when every keyword is enforced while generating
    (outputs cannot fail validation), False when some are approximated (``not_enforced`` lists them).

    Args:
        additional_properties: False (default, strict JSON): an object schema that says nothing
            about extra keys (no ``additionalProperties``, ``patternProperties`` or
            ``unevaluatedProperties``) is generated with only its declared properties; True: the
            JSON Schema default (any extra key). A schema that allows extra keys keeps them.
        on_unsupported: ``"approximate"`` (default): a keyword no engine enforces exactly
            (overlapping ``oneOf``, ``not`` without an exact negation, ``propertyNames``...) is
            widened or dropped, everything else is enforced, and the outputs are validated;
            ``"raise"``: ``UnsupportedSchemaError`` here instead (naming the keyword and its path).
        backend: ``"auto"``/``"llguidance"`` enforce the normalised schema with llguidance;
            ``"outlines"`` compiles it to a regex with outlines-core, which ignores some keywords
            (named in the warning; validation still refuses violating outputs).
        whitespace_pattern: the whitespace allowed between tokens on both engines (default: one
            optional space), so a weak model or a beam search cannot pad forever; ``None`` leaves
            the engine's default (unbounded); ``""`` gives compact JSON, where keys and punctuation
            are forced tokens (the best case for ``fast_forward``).
        max_string_length: bounds every string without ``maxLength`` (and without format, pattern or
            enum) to this many characters, and every generated property name that has no bound of
            its own (extra keys; each repetition of a ``patternProperties`` pattern), so small models
            terminate (a string with a ``format``: max(N, 64)); None (default) leaves them unbounded.
        max_items: bounds every array without ``maxItems`` to this many items (an explicit
            ``maxItems`` is never tightened; a ``minItems`` above it raises
            ``UnsupportedSchemaError``), so a small model cannot fill its context inside an array
            it never closes; None (default) leaves them unbounded.
        bounds: how long the values the schema leaves unbounded may be, in one argument: ``"default"``
            (numbers only: integer parts of at most 18 digits, so integers fit an int64, fractions of
            at most 10 digits, no exponent; a strict-mode user does not notice them), ``"small"``
            (the recommended bounds for small models: strings 32 characters, arrays 8 items, integer
            parts 9 digits, fractions 4), a :class:`~continuum.guides.bounds.JsonBounds`, or None
            (nothing bounded). A bound the schema sets itself is never tightened; ``max_string_length``
            and ``max_items`` override the preset's. Non-default number bounds are named in the
            ``SchemaCoverageWarning``; every output is validated against the original schema as always.

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
    spec = GeneratorSpec("json", arguments(locals()))
    _check_model(model)
    guide, prepared = json_for(model.tokenizer, schema, whitespace_pattern=whitespace_pattern, backend=backend,
                               max_string_length=max_string_length, additional_properties=additional_properties,
                               on_unsupported=on_unsupported, max_items=max_items, bounds=bounds)
    gen = Generator(model, sampler, guide, kind="json", parse=prepared.parse, description=prepared.name,
                    guidance=Guidance.make(model.tokenizer, guidance_scale, negative_prompt, guidance_rescale, cfg_mode),
                    fast_forward=fast_forward, token_healing=token_healing, reasoning=reasoning,
                    thinking_budget=thinking_budget, speculate=speculate)
    gen.exact = prepared.exact
    gen.not_enforced = tuple(map(str, (*prepared.approximated, *prepared.engine_ignored)))
    return remember(gen, spec)


def cfg(model, grammar: str, sampler: Sampler | None = None, *, syntax: str = "lark", backend: str = "auto",
        fast_forward: bool = True, token_healing: bool = False,
        guidance_scale: float = 1.0, negative_prompt: NegativePrompt = None,
        guidance_rescale: float = 0.0, cfg_mode: str = "batched", reasoning: Any = False,
         thinking_budget: int | None = None, speculate: Speculator | None = None) -> Generator:
    r"""Text generated by a context-free ``grammar``; returns the text.

    Args:
        grammar: a Lark grammar in llguidance's syntax (``start`` is the start rule; terminals
            are ``UPPERCASE`` rules, quoted strings or ``/regexes/``; there is no ``%ignore``:
            write whitespace into the rules), or a GBNF grammar (llama.cpp's syntax, ``root``
            is the start rule) with ``syntax="gbnf"``, converted with ``llguidance.gbnf_to_lark``.
        syntax: ``"lark"`` (default) or ``"gbnf"``.
        backend: ``"auto"`` or ``"llguidance"`` (the only engine for grammars).

    Invalid grammars raise ``InvalidGrammarError`` here, with the engine's message.

    Example:
        >>> arith = r'''
        ... start: expr
        ... expr: term (("+" | "-") term)*
        ... term: NUMBER | "(" expr ")"
        ... NUMBER: /[0-9]{1,3}/
        ... '''
        >>> cfg(model, arith, samplers.greedy())("1+1=", max_tokens=30)   # doctest: +SKIP
        '(2+7)-13'
    """
    spec = GeneratorSpec("cfg", arguments(locals()))
    _check_model(model)
    guide = grammar_for(model.tokenizer, grammar, syntax, backend)
    return remember(Generator(model, sampler, guide, kind="cfg", description=repr(grammar.strip().splitlines()[0][:40]),
                     guidance=Guidance.make(model.tokenizer, guidance_scale, negative_prompt, guidance_rescale, cfg_mode),
                     fast_forward=fast_forward, token_healing=token_healing, reasoning=reasoning,
                     thinking_budget=thinking_budget, speculate=speculate), spec)


for _f in (text, regex, choice, json, cfg):
    assert _f.__doc__ is not None  # each has a docstring (under python -OO the += failed before too)
    _f.__doc__ += _GUIDANCE_DOC
