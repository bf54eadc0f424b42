"""Token healing: back up a row's last token and let the first generated token re-cover its text.

A prompt that ends inside what would be one token (``"Visit https:"`` before ``"//"``) ends on an
unusual token boundary: the model has rarely seen ``":"`` followed by ``"//"`` as two tokens, since
the tokenizer writes ``"://"`` as one. Healing removes the last token (its text stays the prompt's:
it is not part of the output) and constrains the first generated token to the tokens whose bytes
start with the removed token's bytes, so the model may pick ``"://"``.

* A row is healed only when some token strictly extends the removed one, which is not a special
  token, and the row keeps at least one token. Candidate sets are memoised per removed token.
* With a guide, a candidate is allowed only if the guide accepts the rest of its bytes (after the
  removed prefix): the rest is encoded as a continuation and walked from a copy of the row's guide
  state; the state after the first token is that walked state.
* The state keeps its last token out of the KV cache, so removing it computes nothing again; if the
  row's new last token was cached, the cache is cut there (``SequenceState._rebuild`` moves it into
  the uncached suffix). A removed *generated* token takes its log-prob out of the weights.

Example:
    >>> gen = generate.text(model, samplers.greedy(), token_healing=True)   # doctest: +SKIP
    >>> gen("Visit https:", max_tokens=5)                                   # doctest: +SKIP
    '//www.example'
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..guides import DEAD

__all__ = ["Heal", "candidates", "heal", "apply_heal_masks"]


@dataclass
class Heal:
    """One healed row: the removed token, the characters it covered, and the allowed first tokens."""

    removed: int
    chars: int
    allowed: torch.Tensor  # ids whose bytes start with the removed token's bytes (and the guide accepts)
    states: dict[int, Any] | None = None  # guided: the guide state after each allowed id

    def state_after(self, guide, token: int):
        """The guide state after the healed first token (a copy: a state belongs to one row)."""
        assert self.states is not None, "state_after is only called on guided heals"
        return guide.copy(self.states[token])


def _sorted_vocab(tokenizer) -> tuple[list[bytes], list[int]]:
    cache = tokenizer.heal_cache
    if "_sorted" not in cache:
        pairs = sorted((b, i) for i, b in enumerate(tokenizer.vocab_bytes) if b)
        cache["_sorted"] = ([b for b, _ in pairs], [i for _, i in pairs])
    return cache["_sorted"]


def candidates(tokenizer, token: int) -> list[int] | None:
    """Ids whose bytes start with ``token``'s bytes, or ``None`` when healing ``token`` changes
    nothing (a special token, or no token strictly extends it). Memoised per token.

    Example:
        >>> [tok.hf.convert_ids_to_tokens(i) for i in candidates(tok, tok.encode_continuation(":")[0])][:3]  # doctest: +SKIP
        [':', '://', '::']
    """
    cache = tokenizer.heal_cache
    if token in cache:
        return cache[token]
    data = tokenizer.vocab_bytes[token] if token < len(tokenizer.vocab_bytes) else None
    found = None
    if data and token not in tokenizer.special_ids:
        keys, ids = _sorted_vocab(tokenizer)
        out, k = [], bisect.bisect_left(keys, data)
        while k < len(keys) and keys[k].startswith(data):
            out.append(ids[k])
            k += 1
        if any(len(keys[j]) > len(data) for j in range(bisect.bisect_left(keys, data), k)):
            found = out
    cache[token] = found
    return found


def _guided(tokenizer, guide, state, token: int, cands: list[int], vocab_size: int) -> tuple[list[int], dict[int, Any]]:
    """The candidates whose bytes after the removed token's the guide accepts, with the walked states."""
    vb, cut = tokenizer.vocab_bytes, len(tokenizer.vocab_bytes[token])
    allowed_now = torch.isfinite(guide.apply_mask(torch.zeros(1, vocab_size), [state])[0]).nonzero().flatten().tolist()
    first = {vb[a][0] for a in allowed_now if a < len(vb) and vb[a]}  # a rest must start with one of these bytes
    rests: dict[int, str] = {}
    for c in cands:
        rest = vb[c][cut:]
        if rest and rest[0] not in first:
            continue
        try:
            rests[c] = rest.decode("utf-8")
        except UnicodeDecodeError:  # the rest ends inside a character: no guide can walk it
            continue
    encoded = tokenizer.encode_continuations(list(rests.values()))
    allowed, states = [], {}
    for c, ids in zip(rests, encoded):
        s = guide.copy(state)
        for t in ids:
            s = guide.advance(s, t)
            if s is DEAD:
                break
        if s is not DEAD:
            allowed.append(c)
            states[c] = s
    return allowed, states


def heal(state, guide, guide_states: Sequence[Any], skip: Sequence[bool]):
    """Back up the last token of every row that can be healed.

    Returns ``(new state, plans)`` with ``plans[r]`` a :class:`Heal` or ``None``. ``guide_states``:
    each row's guide state before generating (``None`` without a guide); ``skip[r]``: leave row ``r``
    alone (it resumes an unfinished constrained step, which ends where the text ends).
    """
    tok = state._model.tokenizer
    real, cached = state._real_rows(), state._cached_real()
    plans: list[Heal | None] = [None] * state.rows
    memo = tok.heal_cache.setdefault("_guided", {})
    for r, (ids, _) in enumerate(real):
        if skip[r] or len(ids) < 2:
            continue
        cands = candidates(tok, ids[-1])
        if cands is None:
            continue
        full, kept = tok.decode(ids[-8:]), tok.decode(ids[-8:-1])
        if not full.startswith(kept) or "\ufffd" in full[len(kept):]:  # the token ends inside a character
            continue
        states = None
        if guide is not None:
            key = (guide.key, guide_states[r], ids[-1]) if guide.copy_free else None
            found = memo.get(key) if key is not None else None
            if found is None:
                found = _guided(tok, guide, guide_states[r], ids[-1], cands, state._model.vocab_size)
                if key is not None:
                    memo[key] = found
            cands, states = found
        plans[r] = Heal(ids[-1], 0, torch.tensor(cands, dtype=torch.long), states)
    if not any(plans):
        return state, plans
    weights = state._weights.clone()
    tails = []
    for r, ((ids, lps), c) in enumerate(zip(real, cached)):
        if plans[r] is None:
            tails.append((ids[c:], lps[c:]))
            continue
        if not math.isnan(lps[-1]):  # a generated token: its log-prob leaves the weights
            weights[r] -= lps[-1]
        tails.append((ids[c:len(ids) - 1], lps[c:len(ids) - 1]))
    before = state.texts
    healed = state._rebuild(cached, tails, weights, state._last)
    for r, text in enumerate(healed.texts):
        plan = plans[r]
        if plan is not None:
            plan.chars = len(before[r]) - len(text)
    return healed, plans


def apply_heal_masks(logprobs: torch.Tensor, plans: Sequence[Heal | None]) -> torch.Tensor:
    """Keep only each healed row's allowed first tokens (other rows untouched)."""
    rows = [(r, p) for r, p in enumerate(plans) if p is not None]
    if not rows:
        return logprobs
    mask = torch.zeros_like(logprobs)
    for r, p in rows:
        keep = torch.full((logprobs.shape[-1],), float("-inf"), device=logprobs.device)
        keep[p.allowed.to(logprobs.device)] = 0.0
        mask[r] = keep
    return logprobs + mask
