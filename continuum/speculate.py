"""Speculative decoding on states: draft tokens cheaply, verify them all in the step's one forward.

A decode step reads every weight once whatever the number of new tokens per row, so on a memory-bound model several
tokens of one row cost little more than one. A *speculator* proposes the tokens a row will probably write next;
the loop (:mod:`continuum.loop.steps`) appends them after the row's sampled token, computes them in the same
forward, and keeps the longest prefix the sampler agrees with, position by position, under the row's constraint.
The state never holds a rejected token: its columns become holes, its KV is cut (llama.cpp) or masked
(transformers).

:func:`lookup` drafts from the row's own tokens (prompt lookup decoding): the row's last ``ngram`` tokens are
searched for earlier in the row (the prompt, the history a state carries, what it generated), and the tokens that
followed that occurrence are the draft. A state is the corpus: a continued chat drafts from every earlier turn.

Exactness: greedy gives the tokens of the same call without speculation (verification takes the argmax of the
same masked log-probs; on transformers fp32 the logits agree within 1e-4, on llama.cpp within its one-batch vs
one-token tolerance); multinomial keeps the exact distribution (a drafted token is kept exactly when the token
sampled at its position is that token). Beam search is refused.

Example:
    >>> from continuum import continuous, generate, samplers, speculate
    >>> gen = continuous(generate.text(model, samplers.greedy(), speculate=speculate.lookup()))   # doctest: +SKIP
    >>> out = gen("Repeat: the cat sat on the mat. Repeat: the cat", max_tokens=16)                # doctest: +SKIP
    >>> out.last.speculation                                                                     # doctest: +SKIP
    {'forwards': 4, 'drafted': 21, 'accepted': 12}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import GeneratorArgumentError

__all__ = ["Lookup", "Speculator", "lookup", "check_speculator"]


@dataclass(frozen=True)
class Lookup:
    """Drafts from the row's own tokens: the continuation of the latest earlier occurrence of its last ``ngram``
    tokens (falling back to shorter keys down to ``min_ngram``), at most ``max_draft`` tokens.

    Attributes:
        ngram: the longest key tried (the row's last ``ngram`` tokens).
        max_draft: the most tokens drafted per row and step.
        min_ngram: the shortest key tried (a 1-token key matches often and is right less often).
        max_calls: draft only while at most this many calls share the engine's step: a step of many rows is
            compute-bound, where drafted positions cost their share (measured on the CPU: 32 programs 0.74x).
    """

    ngram: int = 3
    max_draft: int = 8
    min_ngram: int = 2
    max_calls: int = 4

    def __post_init__(self) -> None:
        for name in ("ngram", "max_draft", "min_ngram", "max_calls"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GeneratorArgumentError(f"speculate.lookup: {name} must be a positive int, got {value!r}")
        if self.min_ngram > self.ngram:
            raise GeneratorArgumentError(f"speculate.lookup: min_ngram ({self.min_ngram}) must not exceed ngram "
                                         f"({self.ngram})")

    def draft(self, history: np.ndarray, limit: int) -> list[int]:
        """At most ``limit`` tokens that followed the latest earlier occurrence of ``history``'s last tokens.

        >>> Lookup(ngram=2).draft(np.array([5, 6, 7, 8, 9, 5, 6]), 3)
        [7, 8, 9]
        """
        n = len(history)
        limit = min(limit, self.max_draft)
        if limit <= 0:
            return []
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
                f"max_calls={self.max_calls})")


Speculator = Lookup  # (the one kind today; a draft model's speculator is not built yet)


def lookup(ngram: int = 3, max_draft: int = 8, min_ngram: int = 2, max_calls: int = 4) -> Lookup:
    """A speculator that drafts from the row's own tokens (see :class:`Lookup`).

    Example:
        >>> lookup(ngram=2, max_draft=4)
        speculate.lookup(ngram=2, max_draft=4, min_ngram=2, max_calls=4)
    """
    return Lookup(ngram=ngram, max_draft=max_draft, min_ngram=min_ngram, max_calls=max_calls)


def check_speculator(speculate: object, sampler: Any) -> Lookup | None:
    """``speculate=`` as a generator (and the loop) takes it with ``sampler``: None or a speculator, never with beam
    search (else a clear error)."""
    if speculate is None:
        return None
    if not isinstance(speculate, Lookup):
        raise GeneratorArgumentError(f"speculate must be None or a speculator such as continuum.speculate.lookup(), "
                                     f"got {type(speculate).__name__}")
    if sampler.is_beam_search:
        raise GeneratorArgumentError("speculate= does not combine with beam search (a beam's next tokens are not one "
                                     "row's): use samplers.greedy() or multinomial(), or drop speculate")
    return speculate
