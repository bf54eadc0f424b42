"""continuum's constraints as llama-cpp-python logits processors: ``Llama.create_completion(logits_processor=...)``.

llama-cpp-python calls a processor once per generated token as ``processor(input_ids, scores)`` (numpy: every id so
far, prompt included, and the next token's ``n_vocab`` logits) and samples from what it returns. These processors
are the ones of :mod:`continuum.processors` (the same guides, the same dead-row and EOS handling) over the GGUF's
own tokenizer: :class:`~continuum.models.llamacpp.LlamaTokenizer` reading the ``Llama`` object's ``llama_vocab``
(the very ids it samples, no second load of the weights; the vocabulary and compiled guides are cached per
``Llama``).

One generation at a time: the first call fixes the prompt; each later call must extend the previous input by the
token sampled from the mask just returned. Any other input is a new generation and starts afresh (so an instance
reused for the next ``create_completion`` call resets itself; :meth:`LlamaCppLogitsProcessor.reset` does it
explicitly). An exception raised inside a processor is printed and ignored by llama-cpp-python (the ctypes
callback swallows it) and the text would go on unconstrained, so a processor never raises there: on an internal
error it allows only end-of-generation tokens, keeps the error in ``.error`` and warns.

Example:
    >>> import llama_cpp
    >>> from continuum.processors import llamacpp_regex
    >>> llm = llama_cpp.Llama("stories260K-f32.gguf")                                 # doctest: +SKIP
    >>> proc = llamacpp_regex(llm, r" [0-9]{3}")                                        # doctest: +SKIP
    >>> llm.create_completion("Call", max_tokens=8, logits_processor=llama_cpp.LogitsProcessorList([proc]))  # doctest: +SKIP
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .hf import (
    ChoiceLogitsProcessor,
    GrammarLogitsProcessor,
    GuideLogitsProcessor,
    JSONLogitsProcessor,
    RegexLogitsProcessor,
)

__all__ = ["LlamaCppLogitsProcessor", "llamacpp_tokenizer", "llamacpp_regex", "llamacpp_choice", "llamacpp_json",
           "llamacpp_grammar"]

_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


class _LlamaVocab:
    """What :class:`~continuum.models.llamacpp.LlamaTokenizer` reads from a model, from a llama-cpp-python ``Llama``
    (holding it keeps the vocabulary pointer alive)."""

    def __init__(self, llama: Any):
        self.llama = llama
        self.vocab_ptr = llama._model.vocab
        self.n_vocab = int(llama.n_vocab())
        self.path = Path(llama.model_path)

    def metadata(self, key: str) -> str | None:
        return self.llama.metadata.get(key)


def llamacpp_tokenizer(llama: Any) -> Any:
    """continuum's tokenizer over ``llama``'s own vocabulary (one per ``Llama``: its compiled guides are reused)."""
    tok = _TOKENIZERS.get(llama)
    if tok is None:
        from ..models.llamacpp.vocab import LlamaTokenizer

        tok = _TOKENIZERS[llama] = LlamaTokenizer(_LlamaVocab(llama))  # type: ignore[arg-type]
    return tok


class LlamaCppLogitsProcessor:
    """A continuum guide processor in llama-cpp-python's form (1-D numpy ids and scores); see the module docstring.

    Attributes:
        processor: the :class:`~continuum.processors.GuideLogitsProcessor` it runs (its guide, ``parse`` for JSON).
        error: the exception that stopped the last generation early (only end-of-generation was allowed), or None.
    """

    def __init__(self, processor: GuideLogitsProcessor):
        self.processor = processor
        self.error: BaseException | None = None
        self._last: np.ndarray | None = None  # the previous call's input
        self._allowed: np.ndarray | None = None  # the mask returned to it

    def __repr__(self) -> str:
        return f"LlamaCppLogitsProcessor({self.processor!r})"

    def reset(self) -> None:
        """Start a new generation at the next call."""
        self.processor.reset()
        self._last = self._allowed = None
        self.error = None

    def _continues(self, ids: np.ndarray) -> bool:
        last, allowed = self._last, self._allowed
        return (last is not None and allowed is not None and len(ids) == len(last) + 1
                and bool(np.array_equal(ids[:-1], last)) and 0 <= int(ids[-1]) < len(allowed) and bool(allowed[ids[-1]]))

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        ids = np.asarray(input_ids, dtype=np.int64)
        logits = np.ascontiguousarray(scores, dtype=np.float32)
        if not self._continues(ids):
            self.reset()
        try:
            out = self.processor(torch.from_numpy(ids[None]), torch.from_numpy(logits[None]))[0].numpy()
        except Exception as exc:  # noqa: BLE001  (llama-cpp-python would swallow it and sample unconstrained)
            self.error = exc
            warnings.warn(f"{self!r} failed ({type(exc).__name__}: {exc}): the generation is ended here", RuntimeWarning,
                          stacklevel=2)
            out = np.full_like(logits, -math.inf)
            eos = sorted(self.processor._eos)
            out[eos] = np.where(np.isfinite(logits[eos]), logits[eos], 0.0)
        self._last, self._allowed = ids, np.isfinite(out)
        return out

    def parse(self, text: str) -> Any:
        """JSON processors: the value of a generated text, validated against the schema (``SchemaViolationError``)."""
        if not isinstance(self.processor, JSONLogitsProcessor):
            raise TypeError("parse() is for JSON processors (llamacpp_json)")
        return self.processor.parse(text)


def llamacpp_regex(llama: Any, pattern: str, *, backend: str = "auto") -> LlamaCppLogitsProcessor:
    """Generated text matches ``pattern`` (as ``generate.regex``); ``llama``: a ``llama_cpp.Llama``."""
    return LlamaCppLogitsProcessor(RegexLogitsProcessor(pattern, llamacpp_tokenizer(llama), backend=backend))


def llamacpp_choice(llama: Any, choices: Sequence[str], *, backend: str = "auto") -> LlamaCppLogitsProcessor:
    """Generated text is exactly one of ``choices`` (token by token)."""
    return LlamaCppLogitsProcessor(ChoiceLogitsProcessor(choices, llamacpp_tokenizer(llama), backend=backend))


def llamacpp_json(llama: Any, schema: Any, **options: Any) -> LlamaCppLogitsProcessor:
    """Generated text is JSON following ``schema`` (options and ``on_unsupported="raise"`` as
    :class:`~continuum.processors.JSONLogitsProcessor`); check outputs with ``.parse(text)``."""
    return LlamaCppLogitsProcessor(JSONLogitsProcessor(schema, llamacpp_tokenizer(llama), **options))


def llamacpp_grammar(llama: Any, grammar: str, *, syntax: str = "lark") -> LlamaCppLogitsProcessor:
    """Generated text follows a context-free grammar (llguidance Lark, or GBNF with ``syntax="gbnf"``)."""
    return LlamaCppLogitsProcessor(GrammarLogitsProcessor(grammar, llamacpp_tokenizer(llama), syntax=syntax))
