"""The outlines-core engine: regex and choice compiled to outlines-core indexes, and vectorised masks.

outlines-core does the real work (regex -> token-level automaton over the vocabulary). This module
caches compiled indexes per (pattern, tokenizer), turns a guide state into the tensor of allowed
token ids (memoised per state), and builds the additive logits mask of a whole batch with one
``index_put``.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from ..errors import EmptyChoicesError, InvalidRegexError

__all__ = ["Guide", "regex_guide", "choice_regex", "escape", "build_mask"]

# Characters with a meaning in outlines-core's (Rust) regex syntax.
_META = set("\\.+*?()|[]{}^$#&-~")
_LOCK = threading.Lock()


def escape(text: str) -> str:
    """Escape ``text`` for outlines-core's regex syntax (Python's ``re.escape`` escapes more)."""
    return "".join("\\" + c if c in _META else c for c in text)


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of ``choices``."""
    if isinstance(choices, str):
        raise EmptyChoicesError("generate.choice takes a list of options, not a single string")
    options = list(choices)
    if not options:
        raise EmptyChoicesError("generate.choice needs at least one option, e.g. ['yes', 'no']")
    bad = [o for o in options if not isinstance(o, str) or o == ""]
    if bad:
        raise EmptyChoicesError(f"choice options must be non-empty strings; got {bad!r}")
    return "(" + "|".join(escape(o) for o in options) + ")"


class Guide:
    """A compiled constraint: an outlines-core ``Index`` plus memoised per-state allowed ids.

    Guide states are plain ints (outlines-core automaton states), so per-row guide state in the
    decoding loop is a list of ints that reorders like any other per-row state.

    Example:
        >>> guide = regex_guide(r"[0-9]{3}", model.tokenizer)   # doctest: +SKIP
        >>> s = guide.initial_state; ids = guide.allowed(s)      # doctest: +SKIP
    """

    def __init__(self, regex: str, index: Any, eos_token_id: int):
        self.regex = regex
        self.index = index
        self.eos_token_id = eos_token_id
        self.initial_state: int = index.get_initial_state()
        self._allowed: dict[int, torch.Tensor] = {}
        self._final = set(index.get_final_states())

    def __repr__(self) -> str:
        return f"Guide({self.regex[:60]!r})"

    def allowed(self, state: int) -> torch.Tensor:
        ids = self._allowed.get(state)
        if ids is None:
            ids = torch.tensor(self.index.get_allowed_tokens(state) or [], dtype=torch.long)
            self._allowed[state] = ids
        return ids

    def is_final(self, state: int) -> bool:
        return state in self._final

    def is_done(self, state: int) -> bool:
        """Final and nothing but EOS allowed: the row ends here without sampling."""
        if state not in self._final:
            return False
        ids = self.allowed(state)
        return ids.numel() == 0 or bool((ids == self.eos_token_id).all())

    def advance(self, state: int, token_id: int) -> int | None:
        return self.index.get_next_state(state, token_id)


def regex_guide(regex: str, tokenizer) -> Guide:
    """Compile ``regex`` for ``tokenizer`` (cached per tokenizer: the second call is instant)."""
    from outlines_core import Index

    with _LOCK:
        guide = tokenizer.index_cache.get(regex)
    if guide is not None:
        return guide
    try:
        index = Index(regex, tokenizer.vocabulary)
    except Exception as exc:
        why = ("no text this tokenizer can produce matches it (a pattern that matches nothing, or characters "
               "missing from the vocabulary): fix the pattern") if "incompatible" in str(exc) else (
              "check its syntax (outlines-core takes Rust regex syntax: no lookarounds, backreferences or "
              "Unicode \\b)")
        raise InvalidRegexError(f"cannot compile regex {regex[:200]!r} for this tokenizer: {why}. Cause: {exc}") from exc
    guide = Guide(regex, index, tokenizer.eos_token_id)
    with _LOCK:
        tokenizer.index_cache[regex] = guide
    return guide


def build_mask(guide: Guide, states: Sequence[int | None], vocab_size: int, device) -> torch.Tensor:
    """Additive mask ``(rows, vocab)``: 0 where allowed, -inf elsewhere; ``None`` states are free rows."""
    mask = torch.full((len(states), vocab_size), float("-inf"), device=device)
    rows, cols = [], []
    for r, s in enumerate(states):
        if s is None:
            mask[r] = 0.0
            continue
        ids = guide.allowed(s)
        rows.append(torch.full_like(ids, r))
        cols.append(ids)
    if rows:
        mask.index_put_((torch.cat(rows).to(device), torch.cat(cols).to(device)), torch.zeros((), device=device))
    return mask
