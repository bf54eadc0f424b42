"""The outlines-core engine: regex and choice compiled to outlines-core indexes, and vectorised masks.

outlines-core does the real work (regex -> token-level automaton over the vocabulary). This module
caches compiled indexes per (pattern, tokenizer), turns a guide state into the tensor of allowed
token ids (memoised per state), and builds the additive logits mask of a whole batch with one
``index_put``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import EmptyChoicesError, InvalidRegexError
from ..models.tokenizer import check_encodable

__all__ = ["OutlinesGuide", "regex_guide", "choice_regex", "escape", "build_mask"]

# Characters with a meaning in outlines-core's (Rust) regex syntax.
_META = set("\\.+*?()|[]{}^$#&-~")
_LOCK = threading.Lock()
_MAX_FORCED = 256  # longest forced run returned at once (a fast-forward goes on from there)


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
    check_encodable(options, "choice option")
    return "(" + "|".join(escape(o) for o in options) + ")"


class OutlinesGuide:
    """The outlines-core engine behind the guide protocol (:mod:`continuum.guides.base`): an ``Index``
    plus memoised per-state allowed ids.

    Guide states are plain ints (outlines-core automaton states): immutable values, so reorders and
    forks copy them for free and a finished state can be resumed as is.

    Example:
        >>> guide = regex_guide(r"[0-9]{3}", model.tokenizer)   # doctest: +SKIP
        >>> s = guide.new_state(); ids = guide.allowed(s)        # doctest: +SKIP
    """

    copy_free = True

    def __init__(self, regex: str, index: Any, eos_token_id: int):
        self.regex = regex
        self.key = "outlines:" + regex
        self.index = index
        self.eos_token_id = eos_token_id
        self.initial_state: int = index.get_initial_state()
        self._allowed: dict[int, torch.Tensor] = {}
        self._final = set(index.get_final_states())

    def __repr__(self) -> str:
        return f"OutlinesGuide({self.regex[:60]!r})"

    def new_state(self) -> int:
        return self.initial_state

    def allowed(self, state: int) -> torch.Tensor:
        ids = self._allowed.get(state)
        if ids is None:
            ids = torch.tensor(self.index.get_allowed_tokens(state) or [], dtype=torch.long)
            self._allowed[state] = ids
        return ids

    def apply_mask(self, logprobs: torch.Tensor, states: Sequence[int | None]) -> torch.Tensor:
        return logprobs + build_mask(self, states, logprobs.shape[-1], logprobs.device)

    def is_final(self, state: int | None) -> bool:
        return state in self._final

    def is_done(self, state: int | None) -> bool:
        """Final and nothing but EOS allowed: the row ends here without sampling."""
        if state not in self._final:
            return False
        assert state is not None  # _final holds only int states
        ids = self.allowed(state)
        return ids.numel() == 0 or bool((ids == self.eos_token_id).all())

    def advance(self, state: int | None, token_id: int) -> int | None:
        """The next state, or ``None`` (dead) when ``token_id`` is not allowed."""
        if state is None:
            return None
        return self.index.get_next_state(state, token_id)

    def copy(self, state: int | None) -> int | None:
        return state

    def forced_tokens(self, state: int | None) -> list[int]:
        """The run of tokens forced from ``state``: while exactly one token is allowed and it is not EOS."""
        out: list[int] = []
        while state is not None and len(out) < _MAX_FORCED and state not in self._final:
            ids = self.allowed(state)
            if ids.numel() != 1 or int(ids[0]) == self.eos_token_id:
                break
            out.append(int(ids[0]))
            state = self.index.get_next_state(state, out[-1])
        return out


def regex_guide(regex: str, tokenizer) -> OutlinesGuide:
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
    guide = OutlinesGuide(regex, index, tokenizer.eos_token_id)
    with _LOCK:
        tokenizer.index_cache[regex] = guide
    return guide


def build_mask(guide: OutlinesGuide, states: Sequence[int | None], vocab_size: int, device) -> torch.Tensor:
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
