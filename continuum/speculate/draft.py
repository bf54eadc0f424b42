"""The draft-model speculator: a smaller model whose ids mean the same drafts the next tokens greedily.

Its KV is kept beside the target's, by token prefix: each row's draft leaves the draft model's KV of the row's
tokens (up to its last drafted one) in a small least-recently-used table, and the next step, or the next call on a
continued state, finds the longest entry its tokens start with and computes only what follows. Rejected drafts
are cut off the entry (a crop, never a recomputation of the history).

Exactness: the draft is the draft model's argmax, a point mass ``q``; the standard rejection rule (keep a drafted
token ``d`` with probability ``min(1, p(d) / q(d)) = p(d)``, else draw from ``p`` without ``d``) is then exactly the
loop's rule, "keep the draft while the token the sampler draws equals it", so a multinomial call keeps its exact
distribution and a greedy call its exact tokens. Under a constraint the draft model's logits are masked by the
row's guide, so every drafted token is one the guide allows.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from ..errors import GeneratorArgumentError
from ..guides import DEAD
from ..models import kv as kvcache

__all__ = ["Draft", "draft"]


class Draft:
    """Drafts ``max_draft`` tokens per row and step with ``model`` (greedy, masked by the row's guide).

    Attributes:
        model: the draft model (any continuum backend); its tokenizer must give every id the target's meaning.
        max_draft: the most tokens drafted per row and step (each costs the draft model one forward).
        max_calls: draft only while at most this many calls share the engine's step (see ``speculate.lookup``).
        keep: draft KVs kept (one per row being drafted for, least recently used dropped first); at least as many as
            the most rows one call drafts for.
    """

    def __init__(self, model: Any, max_draft: int = 4, max_calls: int = 4, keep: int = 16):
        for name, value in (("max_draft", max_draft), ("max_calls", max_calls), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GeneratorArgumentError(f"speculate.draft: {name} must be a positive int, got {value!r}")
        if not hasattr(model, "forward_now") or not hasattr(model, "tokenizer"):
            raise GeneratorArgumentError(f"speculate.draft: model must be a continuum model (models.transformers(...) "
                                         f"or models.llamacpp(...)), got {type(model).__name__}")
        self.model, self.max_draft, self.max_calls, self.keep = model, max_draft, max_calls, keep
        self._eos = frozenset(model.tokenizer.eos_token_ids)
        self._entries: list[tuple[np.ndarray, Any]] = []  # (tokens the KV covers, the KV), most recent last
        self._room = keep  # entries kept: ``keep``, or the most rows one call drafted for (expect)
        self._lock = threading.Lock()  # (calls on two target models may share one speculator)

    def check_target(self, target: Any) -> None:
        """A clear error unless the draft model's ids mean what ``target``'s do (the same vocabulary)."""
        mine, theirs = self.model.tokenizer.ids_fingerprint, target.tokenizer.ids_fingerprint
        if mine != theirs:
            raise GeneratorArgumentError(
                f"speculate.draft: the draft model's tokenizer ({self.model.tokenizer.name}) does not give the ids the "
                f"meaning the model's ({target.tokenizer.name}) does: use a draft model of the same family (the same "
                f"vocabulary), or speculate.lookup()")

    def draft(self, history: np.ndarray, limit: int, guide: Any = None, state: Any = None,
              stats: dict | None = None, tokenizer: Any = None) -> list[int]:
        """At most ``limit`` tokens the draft model writes greedily after ``history`` (masked by ``guide`` from the
        row's ``state``, walked on a copy); ``stats["draft_forwards"]`` counts its forwards."""
        limit = min(limit, self.max_draft)
        if limit <= 0 or len(history) == 0:
            return []
        if guide is not None:
            state = guide.copy(state)
        out: list[int]
        with self._lock:
            done, kv = self._reuse(history)
            ids, out = history[done:].tolist(), []
            while len(out) < limit:
                logits, kv = self._forward(ids, done, kv)
                done += len(ids)
                if stats is not None:
                    stats["draft_forwards"] = stats.get("draft_forwards", 0) + 1
                t = self._choose(logits, guide, state)
                if t is None or t in self._eos:
                    break
                out.append(t)
                if guide is not None:
                    state = guide.advance(state, t)
                    if state is DEAD or guide.is_done(state):
                        break
                ids = [t]
            # the KV covers the history and the drafted tokens fed back (every one but the last, or all when the
            self._store(np.concatenate([history, np.asarray(out, dtype=history.dtype)])[:done], kv)  # draft ended)
        return out

    # -- the draft model's KV, by token prefix ---------------------------------------------------------------
    def _reuse(self, history: np.ndarray) -> tuple[int, Any]:
        """The longest kept KV ``history`` starts with, cropped to leave at least its last token to compute (its
        logits draft the first token): ``(columns covered, KV)``."""
        best, at = 0, -1
        for i, (tokens, _) in enumerate(self._entries):
            n = min(len(tokens), len(history) - 1)
            same = np.flatnonzero(tokens[:n] != history[:n])
            common = int(same[0]) if same.size else n
            if common > best:
                best, at = common, i
        if at < 0:
            return 0, None
        tokens, kv = self._entries[at]
        if best == len(tokens):  # this row's own entry: it is replaced by what this draft leaves
            del self._entries[at]
        kv = kvcache.crop(kv, best) if best < kvcache.length(kv) else kv
        return kvcache.length(kv), kv  # (a hybrid model's crop may reach back further: to a recurrent snapshot)

    def expect(self, rows: int) -> None:
        """A call drafts for ``rows`` rows: keep at least that many KVs, or each row's would be dropped before its
        next step needs it (a list call of more rows than ``keep`` prefilled every row's history at every step)."""
        self._room = max(self._room, rows)

    def _store(self, tokens: np.ndarray, kv: Any) -> None:
        self._entries.append((tokens, kv))
        del self._entries[:-self._room]

    def _forward(self, ids: list[int], done: int, kv: Any) -> tuple[torch.Tensor, Any]:
        device = self.model.device
        x = torch.tensor([ids], dtype=torch.long, device=device)
        mask = torch.ones(1, done + len(ids), dtype=torch.long, device=device)
        pos = torch.arange(done, done + len(ids), device=device)[None]
        logits, kv = self.model.forward_now(x, mask, pos, kv, logits="last")
        return logits.reshape(1, -1).float(), kv

    @staticmethod
    def _choose(logits: torch.Tensor, guide: Any, state: Any) -> int | None:
        """The draft model's argmax, among the tokens the guide allows from ``state`` (None: it allows none)."""
        if guide is not None:
            logits = guide.apply_mask(torch.log_softmax(logits, -1), [state])
        best = int(logits[0].argmax())
        return None if logits[0, best] == -float("inf") else best

    def __repr__(self) -> str:
        return f"speculate.draft({self.model!r}, max_draft={self.max_draft}, max_calls={self.max_calls}, keep={self.keep})"


def draft(model: Any, max_draft: int = 4, max_calls: int = 4, keep: int = 16) -> Draft:
    """A speculator that drafts with a smaller ``model`` of the same vocabulary (see :class:`Draft`).

    Example:
        >>> small = models.transformers("HuggingFaceTB/SmolLM2-135M")                              # doctest: +SKIP
        >>> gen = generate.text(models.transformers("HuggingFaceTB/SmolLM2-1.7B"), speculate=draft(small))  # doctest: +SKIP
    """
    return Draft(model, max_draft=max_draft, max_calls=max_calls, keep=keep)
