"""continuum's constraints and classifier-free guidance as ``transformers`` logits processors (see the package
docstring, :mod:`continuum.processors`)."""

from __future__ import annotations

import math
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from transformers import LogitsProcessor

from ..models.hf import cache as kvcache
from ..models.hf import dynamic
from ..models.tokenizer import Tokenizer

_TOKENIZERS: weakref.WeakKeyDictionary[Any, Tokenizer] = weakref.WeakKeyDictionary()
_DEAD, _DONE = object(), object()  # row states: a disallowed token was chosen / EOS was generated


def _adapter(tokenizer) -> Tokenizer:
    """continuum's tokenizer adapter for a Hugging Face tokenizer, one per tokenizer object (its
    compiled-index caches are reused across processors); a continuum adapter (llama.cpp's too) as is."""
    if isinstance(tokenizer, Tokenizer) or type(tokenizer).__module__.startswith("continuum."):
        return tokenizer
    adapter = _TOKENIZERS.get(tokenizer)
    if adapter is None:
        adapter = _TOKENIZERS[tokenizer] = Tokenizer(tokenizer)
    return adapter


def _to_torch(array) -> tuple[torch.Tensor, Any]:
    """(tensor, namespace to convert back with; ``None`` for torch), sharing memory via DLPack."""
    if isinstance(array, torch.Tensor):
        return array, None
    if not hasattr(array, "__dlpack__"):
        raise TypeError(f"expected a torch tensor or a DLPack array (e.g. NumPy), got {type(array).__name__}")
    namespace = array.__array_namespace__() if hasattr(array, "__array_namespace__") else None
    if namespace is None:
        raise TypeError(f"{type(array).__name__} has no array-API namespace to convert the result back")
    return torch.from_dlpack(array), namespace


def _from_torch(tensor: torch.Tensor, namespace) -> Any:
    return tensor if namespace is None else namespace.from_dlpack(tensor)


class _Rows:
    """Tracks the rows of one ``generate()`` call: each row's generated suffix and its parent row."""

    def __init__(self) -> None:
        self.width: int | None = None  # prompt width, fixed by the first call
        self.keys: list[tuple[int, ...]] = []

    def reset(self) -> None:
        self.width, self.keys = None, []

    def step(self, input_ids: torch.Tensor) -> tuple[list[tuple[int, ...]], list[int | None]]:
        """(keys of the current rows, index of each row's parent in the previous call; ``None`` on the first call
        or when a row's history is unknown)."""
        if self.width is None or input_ids.shape[1] < self.width:
            self.width, self.keys = input_ids.shape[1], []
        keys = [tuple(row) for row in input_ids[:, self.width:].tolist()]
        where = {k: i for i, k in enumerate(self.keys)}
        parents = [where.get(k[:-1]) if k else None for k in keys]
        self.keys = keys
        return keys, parents


class GuideLogitsProcessor(LogitsProcessor):
    """Masks the scores of every row to the tokens its guide allows (base class of the constraint processors).

    Args:
        guide: a compiled continuum guide (``continuum.guides``).
        tokenizer: the Hugging Face tokenizer (or continuum adapter) the guide was compiled for.
    """

    def __init__(self, guide, tokenizer):
        self.guide = guide
        self.tokenizer = _adapter(tokenizer)
        self._eos = sorted(self.tokenizer.eos_token_ids)
        self._rows = _Rows()
        self._states: list[Any] = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.guide!r})"

    def reset(self) -> None:
        """Forget the previous ``generate()`` call (a processor serves one call at a time)."""
        self._rows.reset()
        self._states = []

    def _advance(self, parent: Any, token: int, shared: bool) -> Any:
        """The state after ``token``; ``shared``: the parent's state has another heir, so work on a copy."""
        if parent is _DEAD or parent is _DONE:
            return parent
        if token in self._eos:
            return _DONE
        if shared and not self.guide.copy_free:
            parent = self.guide.copy(parent)
        state = self.guide.advance(parent, token)
        return _DEAD if state is None else state

    def __call__(self, input_ids, scores):
        ids, _ = _to_torch(input_ids)
        logits, namespace = _to_torch(scores)
        keys, parents = self._rows.step(ids)
        heirs = Counter(parents)  # a stateful engine advances in place: every heir but the last works on a copy
        states = []
        for key, parent in zip(keys, parents):
            if not key:
                states.append(self.guide.new_state())
            elif parent is not None:
                heirs[parent] -= 1
                states.append(self._advance(self._states[parent], key[-1], heirs[parent] > 0))
            else:  # unknown history (e.g. input_ids edited between calls): replay the suffix
                state = self.guide.new_state()
                for token in key:
                    state = self._advance(state, token, False)
                states.append(state)
        self._states = states
        live = [None if s is _DONE or s is _DEAD else s for s in states]  # None: left untouched
        out = self.guide.apply_mask(logits.to(torch.float32, copy=True), live)  # never write into the caller's scores
        for r, s in enumerate(states):
            if s is _DEAD or not bool(torch.isfinite(out[r]).any()):  # only EOS: never an all -inf row
                eos_scores = out[r, self._eos]
                out[r] = -math.inf
                out[r, self._eos] = torch.where(torch.isfinite(eos_scores), eos_scores, torch.zeros_like(eos_scores))
        return _from_torch(out.to(logits.dtype), namespace)


class RegexLogitsProcessor(GuideLogitsProcessor):
    """Generated text matches ``pattern`` (outlines-core regex syntax; ``backend`` as in ``generate.regex``).

    Example:
        >>> proc = RegexLogitsProcessor(r"(yes|no)\\.", tokenizer)   # doctest: +SKIP
    """

    def __init__(self, pattern: str, tokenizer, *, backend: str = "auto"):
        from ..guides.compile import regex_for

        adapter = _adapter(tokenizer)
        super().__init__(regex_for(adapter, pattern, backend), adapter)


class ChoiceLogitsProcessor(GuideLogitsProcessor):
    """Generated text is exactly one of ``choices`` (token by token, like ``choice(method="greedy")``)."""

    def __init__(self, choices: Sequence[str], tokenizer, *, backend: str = "auto"):
        from ..guides import choice_regex
        from ..guides.compile import regex_for

        adapter = _adapter(tokenizer)
        super().__init__(regex_for(adapter, choice_regex(choices), backend), adapter)


class JSONLogitsProcessor(GuideLogitsProcessor):
    """Generated text is JSON following a pydantic model class or a JSON schema (dict or string), with the
    engine and normaliser of ``generate.json``; :meth:`parse` parses and validates a generated text
    against the original schema (raising ``SchemaViolationError``).

    Objects are closed by default (``additional_properties=False``, as in ``generate.json``). Unlike
    the generators, ``on_unsupported`` defaults to ``"raise"``: ``model.generate()`` returns token ids
    that nothing validates, so a schema that cannot be enforced exactly raises
    ``UnsupportedSchemaError`` here. ``on_unsupported="approximate"`` generates under a wider
    schema and warns (``SchemaCoverageWarning``) that every output must be checked with
    :meth:`parse`; :attr:`exact` says whether it is needed. ``bounds`` (``"default"``: numbers within
    int64 and fractions of 10 digits; ``"small"`` for small models; a ``JsonBounds``; None), and
    ``max_string_length`` and ``max_items``, bound the values that have no bound of their own (as in
    ``generate.json``).
    """

    def __init__(self, schema: Any, tokenizer, *, whitespace_pattern: str | None = r"[ ]?", backend: str = "auto",
                 max_string_length: int | None = None, additional_properties: bool = False,
                 on_unsupported: str = "raise", max_items: int | None = None, bounds: Any = "default"):
        import warnings

        from ..guides.compile import json_for
        from ..guides.schema import SchemaCoverageWarning

        adapter = _adapter(tokenizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            guide, prepared = json_for(adapter, schema, whitespace_pattern=whitespace_pattern, backend=backend,
                                       max_string_length=max_string_length, additional_properties=additional_properties,
                                       on_unsupported=on_unsupported, max_items=max_items, bounds=bounds)
        for w in caught:
            message = str(w.message)
            if issubclass(w.category, SchemaCoverageWarning) and not prepared.exact:
                message += (" | model.generate() does not validate its outputs: check each decoded text with "
                            "JSONLogitsProcessor.parse(text), which raises SchemaViolationError")
            warnings.warn(message, w.category, stacklevel=2)
        self._parse = prepared.parse
        self.exact: bool = prepared.exact
        self.not_enforced = tuple(map(str, (*prepared.approximated, *prepared.engine_ignored)))
        super().__init__(guide, adapter)

    def parse(self, text: str) -> Any:
        """The value of a generated ``text`` (the decoded new tokens), validated against the original
        schema: raises ``SchemaViolationError`` when it is not valid JSON or fails the schema."""
        return self._parse(text)


class GrammarLogitsProcessor(GuideLogitsProcessor):
    """Generated text follows a context-free grammar (llguidance Lark syntax, or GBNF with ``syntax="gbnf"``)."""

    def __init__(self, grammar: str, tokenizer, *, syntax: str = "lark"):
        from ..guides.compile import grammar_for

        adapter = _adapter(tokenizer)
        super().__init__(grammar_for(adapter, grammar, syntax), adapter)


def _hf_model(model):
    return getattr(model, "model", model) if not hasattr(model, "generate") else model


class GuidanceLogitsProcessor(LogitsProcessor):
    """Classifier-free guidance inside ``generate()``: ``uncond + scale * (cond - uncond)`` on log-probs.

    The unconditional branch is the negative prompt (``negative_prompt_ids``: one row for all, or
    one per batch item; default: the model's BOS token, or each row's last prompt token when it
    has none) followed by the tokens each row generated. It keeps its own KV cache for the whole
    call and follows beam-search reorders (rows are matched by their generated tokens), so each
    step runs ONE forward of one column per row. ``guidance_scale == 1`` returns the scores as
    they are, running nothing.

    Args:
        guidance_scale: 1 disables guidance; > 1 pushes away from the negative prompt.
        model: the Hugging Face model (or continuum model) computing the unconditional scores.
        negative_prompt_ids: ``(1 or batch, length)`` token ids (torch or NumPy), left-padded with
            ``negative_attention_mask`` when rows differ in length.
        guidance_rescale: ``r`` blends back the conditional log-probs: ``r * cond + (1 - r) * guided``.

    Example:
        >>> neg = tokenizer(["A sad story:"], return_tensors="pt").input_ids          # doctest: +SKIP
        >>> proc = GuidanceLogitsProcessor(3.0, hf_model, negative_prompt_ids=neg)          # doctest: +SKIP
        >>> hf_model.generate(**inputs, logits_processor=LogitsProcessorList([proc]))  # doctest: +SKIP
    """

    def __init__(self, guidance_scale: float, model, negative_prompt_ids=None, guidance_rescale: float = 0.0,
                 negative_attention_mask=None):
        from ..loop.cfg import Guidance

        Guidance.make(None, guidance_scale, None, guidance_rescale)  # the generators' argument checks
        self.guidance_scale, self.guidance_rescale = float(guidance_scale), float(guidance_rescale)
        self.model = _hf_model(model)
        self._negative = None if negative_prompt_ids is None else _to_torch(negative_prompt_ids)[0].long()
        self._negative_mask = None if negative_attention_mask is None else _to_torch(negative_attention_mask)[0].long()
        self._rows = _Rows()
        self.reset()

    def reset(self) -> None:
        """Forget the previous ``generate()`` call."""
        self._rows.reset()
        self._kv: kvcache.KV | None = None
        self._mask: torch.Tensor | None = None

    def _start(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The unconditional rows' first tokens and mask."""
        rows = ids.shape[0]
        if self._negative is None:
            bos = getattr(self.model.config, "bos_token_id", None)
            neg = ids[:, -1:] if bos is None else torch.full((rows, 1), int(bos), dtype=torch.long)
            mask = torch.ones_like(neg)
        else:
            neg = self._negative.to(ids.device)
            mask = self._negative_mask.to(ids.device) if self._negative_mask is not None else torch.ones_like(neg)
            if neg.shape[0] != rows:
                if rows % neg.shape[0]:
                    raise ValueError(f"negative_prompt_ids has {neg.shape[0]} rows, which does not divide the "
                                     f"{rows} rows generate() runs (batch x beams/samples): give 1 or batch rows")
                repeat = rows // neg.shape[0]
                neg, mask = neg.repeat_interleave(repeat, 0), mask.repeat_interleave(repeat, 0)
        return neg.to(ids.device), mask.to(ids.device)

    def _forward(self, new: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pos = kvcache.positions(mask)[:, -new.shape[1]:]
        past = dynamic.to_dynamic_cache(self._kv, self.model.config)
        with torch.inference_mode():
            out = self.model(input_ids=new, attention_mask=mask, position_ids=pos, **dynamic.cache_kwargs(self.model, past),
                             use_cache=True, logits_to_keep=1)
        self._kv, self._mask = dynamic.from_dynamic_cache(past), mask  # (forward appends to the Cache passed in)
        return out.logits[:, -1].float()

    def _unconditional(self, ids: torch.Tensor) -> torch.Tensor:
        keys, parents = self._rows.step(ids)
        if self._kv is None or any(p is None for p in parents):  # first call, or lost track: (re)build in one pass
            neg, mask = self._start(ids)
            width = self._rows.width
            gen = ids[:, width:]
            self._kv = None
            return self._forward(torch.cat([neg, gen], 1), torch.cat([mask, torch.ones_like(gen)], 1))
        ancestors = torch.tensor(parents, dtype=torch.long)
        self._kv = kvcache.select_rows(self._kv, ancestors)
        assert self._mask is not None  # _forward sets it together with _kv
        mask = self._mask.index_select(0, ancestors.to(self._mask.device))
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], 1)
        return self._forward(ids[:, -1:], mask)

    def __call__(self, input_ids, scores):
        if self.guidance_scale == 1.0:
            return scores
        from ..loop.cfg import guided_scores

        ids, _ = _to_torch(input_ids)
        logits, namespace = _to_torch(scores)
        uncond = self._unconditional(ids.long())
        out = guided_scores(logits.float(), uncond.to(logits.device), self.guidance_scale, self.guidance_rescale)
        return _from_torch(out.to(logits.dtype), namespace)


CFGLogitsProcessor = GuidanceLogitsProcessor  # the earlier name (CFG = classifier-free guidance here)
