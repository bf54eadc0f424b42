"""The n-gram lookup speculator: drafts from the row's own tokens (prompt lookup decoding; see :mod:`continuum.speculate`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import GeneratorArgumentError
from .textlookup import TextLookup

__all__ = ["Lookup", "lookup"]


@dataclass(frozen=True)
class Lookup:
    """Drafts from the row's own tokens: the continuation of the latest earlier occurrence of its last ``ngram``
    tokens (falling back to shorter keys down to ``min_ngram``), at most ``max_draft`` tokens; where no token key
    matches, or inside a constrained JSON value, from the row's text (:mod:`continuum.speculate.textlookup`).

    Attributes:
        ngram: the longest key tried (the row's last ``ngram`` tokens).
        max_draft: the most tokens drafted per row and step.
        min_ngram: the shortest key tried (a 1-token key matches often and is right less often).
        max_calls: draft only while at most this many calls share the engine's step: a step of many rows is
            compute-bound, where drafted positions cost their share (measured on the CPU: 32 programs 0.74x).
        text: also draft by text: the longest end of the row's text (at least ``min_chars`` bytes, or a JSON
            value's start) found earlier, and the text that followed it, tokenized as the model writes it.
        min_chars: the shortest text key outside a JSON value.
    """

    ngram: int = 3
    max_draft: int = 8
    min_ngram: int = 2
    max_calls: int = 4
    text: bool = True
    min_chars: int = 8
    _text: TextLookup = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("ngram", "max_draft", "min_ngram", "max_calls", "min_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GeneratorArgumentError(f"speculate.lookup: {name} must be a positive int, got {value!r}")
        if self.min_ngram > self.ngram:
            raise GeneratorArgumentError(f"speculate.lookup: min_ngram ({self.min_ngram}) must not exceed ngram "
                                         f"({self.ngram})")
        if not isinstance(self.text, bool):
            raise GeneratorArgumentError(f"speculate.lookup: text must be a bool, got {self.text!r}")
        object.__setattr__(self, "_text", TextLookup(self.min_chars))  # (its cache of rows' bytes)

    def draft(self, history: np.ndarray, limit: int, guide: Any = None, state: Any = None,
              stats: dict | None = None, tokenizer: Any = None) -> list[int]:
        """At most ``limit`` tokens that followed the latest earlier occurrence of ``history``'s last tokens; with
        ``tokenizer`` (the model's), where none matches or inside a JSON value (``guide`` given), of the row's text
        (the guide only extends a string value's draft with its closing and forced tokens: the loop cuts the draft
        where the guide refuses a token).

        >>> Lookup(ngram=2).draft(np.array([5, 6, 7, 8, 9, 5, 6]), 3)
        [7, 8, 9]
        """
        limit = min(limit, self.max_draft)
        if limit <= 0:
            return []
        texts = self.text and tokenizer is not None
        if texts and guide is not None:  # a constraint (JSON): its values are tokenized unlike the document's, and
            d = self._text.draft(history, limit, tokenizer, guide, state)  # its keys' punctuation is the row's own
            if d is not None:
                return d
        d = self._tokens(history, limit)
        if d or not texts or guide is not None:
            return d
        return self._text.draft(history, limit, tokenizer) or []

    def _tokens(self, history: np.ndarray, limit: int) -> list[int]:
        n = len(history)
        for k in range(min(self.ngram, n - 1), self.min_ngram - 1, -1):
            # every window of k tokens that some token follows (start i in [0, n-k-1]), except the key itself
            windows = np.lib.stride_tricks.sliding_window_view(history[:n - 1], k)
            hits = np.flatnonzero((windows == history[n - k:]).all(1))
            if hits.size:
                i = int(hits[-1])  # the latest occurrence: what the text is doing now
                return history[i + k:i + k + limit].tolist()
        return []

    def __repr__(self) -> str:
        return (f"speculate.lookup(ngram={self.ngram}, max_draft={self.max_draft}, min_ngram={self.min_ngram}, "
                f"max_calls={self.max_calls}, text={self.text}, min_chars={self.min_chars})")


def lookup(ngram: int = 3, max_draft: int = 8, min_ngram: int = 2, max_calls: int = 4, text: bool = True,
           min_chars: int = 8) -> Lookup:
    """A speculator that drafts from the row's own tokens (see :class:`Lookup`).

    Example:
        >>> lookup(ngram=2, max_draft=4)
        speculate.lookup(ngram=2, max_draft=4, min_ngram=2, max_calls=4, text=True, min_chars=8)
    """
    return Lookup(ngram=ngram, max_draft=max_draft, min_ngram=min_ngram, max_calls=max_calls, text=text,
                  min_chars=min_chars)
