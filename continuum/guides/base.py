"""The guide protocol: what the decoding loop needs from a constraint, whatever the engine.

A *guide* is a compiled constraint (a regex, a JSON schema, a grammar) for one tokenizer. It is
shared and never changes; what changes is the per-row *guide state* (an ``int`` for outlines-core,
an ``LLMatcher`` for llguidance). The loop keeps one state per row and asks the guide to:

* ``new_state()``: a fresh state for a row starting the constraint;
* ``apply_mask(logprobs, states)``: set the disallowed tokens of every row to ``-inf`` (``None``
  states are free rows, left untouched), for the whole batch at once;
* ``advance(state, token)``: the state after ``token``, or :data:`DEAD` (``None``) when the token is
  not allowed. It never raises mid-batch. A stateful engine may update ``state`` in place and
  return it: a state belongs to ONE row, so rows duplicated by a fork or a beam reorder get
  ``copy(state)`` (see ``rows.Rows.reorder``, the one place rows are reordered);
* ``is_final(state)``: the text so far is accepted (EOS allowed);
* ``is_done(state)``: accepted and nothing but EOS allowed, so the row ends without sampling;
* ``copy(state)``: an independent state (free for value states: ``copy_free`` is True);
* ``forced_tokens(state)``: tokens the constraint forces next, ``[]`` when the next token is a real
  choice. It does NOT consume them: ``state`` is left as it was, and the loop advances the row
  through the run with ``advance`` token by token (so a stop string or the ``max_tokens`` budget may
  cut the run). An engine may return a canonical tokenization of forced *text* (llguidance's
  ``compute_ff_tokens``) or the tokens that are each the only one allowed (outlines-core); see
  :mod:`continuum.loop.fastforward`;
* ``key``: a stable string naming the constraint *and* the engine: an unfinished constrained step
  is resumed only by a guide with the same key (``LastStep.guide_key``).

Example (any engine):
    >>> guide = regex_guide(r"[0-9]{2}", model.tokenizer)        # doctest: +SKIP
    >>> s = guide.new_state()                                    # doctest: +SKIP
    >>> logprobs = guide.apply_mask(logprobs, [s])               # doctest: +SKIP
    >>> s = guide.advance(s, int(logprobs.argmax()))             # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Guide", "DEAD", "ENGINES", "check_backend"]

#: What :meth:`Guide.advance` returns for a token the constraint does not allow.
DEAD = None

#: The engines a generator's ``backend=`` may name (``"auto"`` picks per constraint kind).
ENGINES = ("auto", "outlines", "llguidance")


@runtime_checkable
class Guide(Protocol):
    """A compiled constraint, shared by every call and row (see the module docstring)."""

    key: str
    #: True when states are immutable values (copying is free and reorders need not copy).
    copy_free: bool

    def new_state(self) -> Any: ...

    def apply_mask(self, logprobs: torch.Tensor, states: Sequence[Any]) -> torch.Tensor: ...

    def advance(self, state: Any, token_id: int) -> Any: ...

    def is_final(self, state: Any) -> bool: ...

    def is_done(self, state: Any) -> bool: ...

    def copy(self, state: Any) -> Any: ...

    def forced_tokens(self, state: Any) -> list[int]: ...


def check_backend(backend: str, allowed: Sequence[str] = ENGINES) -> str:
    """Validate a generator's ``backend=`` argument (raises ``GeneratorArgumentError``)."""
    from ..errors import GeneratorArgumentError

    if not isinstance(backend, str) or backend not in allowed:
        raise GeneratorArgumentError(f"backend must be one of {', '.join(map(repr, allowed))}, got {backend!r}")
    return backend
