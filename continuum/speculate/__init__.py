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
:func:`draft` drafts with a smaller model of the same vocabulary (its argmax, masked by the row's guide), whose KV
is kept by token prefix beside the target's (:mod:`continuum.speculate.draft`).

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

from typing import Any

from ..errors import GeneratorArgumentError
from .draft import Draft, draft
from .lookup import Lookup, lookup

__all__ = ["Draft", "Lookup", "Speculator", "check_speculator", "draft", "lookup"]

Speculator = Lookup | Draft  # what speculate= takes: draft(history, limit, guide, state, stats) -> tokens (state: the
# row's own guide state, copied by a speculator that walks it)


def check_speculator(speculate: object, sampler: Any, model: Any = None) -> Speculator | None:
    """``speculate=`` as a generator (and the loop) takes it with ``sampler`` (and the target ``model``): None or a
    speculator, never with beam search, a draft model only of the target's vocabulary (else a clear error)."""
    if speculate is None:
        return None
    if not isinstance(speculate, (Lookup, Draft)):
        raise GeneratorArgumentError(f"speculate must be None or a speculator such as continuum.speculate.lookup() "
                                     f"or continuum.speculate.draft(small_model), got {type(speculate).__name__}")
    if sampler.is_beam_search:
        raise GeneratorArgumentError("speculate= does not combine with beam search (a beam's next tokens are not one "
                                     "row's): use samplers.greedy() or multinomial(), or drop speculate")
    if model is not None and getattr(model, "hybrid", None):
        raise GeneratorArgumentError("speculate= is not supported on models with recurrent layers yet (a rejected "
                                     "draft would need the recurrent summary rolled back: docs/hybrid.md): drop speculate")
    if isinstance(speculate, Draft) and model is not None:
        speculate.check_target(model)
    return speculate
