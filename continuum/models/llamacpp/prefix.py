"""The prefix cache on llama.cpp: donor sequences (``models.llamacpp(path, prefix_cache="64MiB")``, off by default).

The same contract as the transformers prefix cache (``docs/prefix_cache.md``): a plain call reuses the KV of the
longest prefix of its prompt that an earlier call on this model computed, so a shared system prompt, few-shot block
or document is computed once. What differs is the storage, which is llama.cpp's own:

* After a call's prefill, each distinct row's prompt is kept as a **donor**: a fork of the row's view
  (``seq_cp``: a new sequence id whose cells are the row's, shared, nothing copied). The row goes on decoding into
  its own sequence; the donor keeps exactly the prompt's positions.
* A later call's row takes the donor with the longest common token prefix (up to its last token, whose logits start
  the generation): ``seq_cp(donor, new, 0, k)``, again shared cells, and only its remaining tokens are decoded.
  Tokens are compared, never hashes; no block granularity (any length ``k``, down to ``min_tokens``).
* A sliding-window model (Gemma 3) reuses a donor at ``k`` only where the window's cells are still there
  (``SequencePool.can_extend``); elsewhere the row computes its prompt itself.
* Budget: ``max_bytes`` over every donor's positions (``kv_bytes_per_token`` each; cells shared with running
  states are counted too, so this bounds what the donors can pin) and at most ``max_donors`` donors (sequence ids
  are llama.cpp's scarce resource; idle donors are spilled to bytes by the pool like any idle sequence). Least
  recently used donors go first; a donor that another donor's tokens extend is replaced by it.

Results: the reused cells are those the same model computed for the same tokens at the same positions. In the
batch-invariant mode a row's remaining tokens prefilled on a donor equal one prefill of the whole prompt exactly
(stories260K); a remainder of ONE token is a one-token decode, which differs from a prefill within the stated
tolerance (``docs/llamacpp.md``), as continuing a state does.

Example:
    >>> model = models.llamacpp("stories260K-f32.gguf", prefix_cache="16MiB")     # doctest: +SKIP
    >>> gen = generate.text(model, samplers.greedy())                               # doctest: +SKIP
    >>> gen(doc + "Q1", max_tokens=8); gen(doc + "Q2", max_tokens=8)                # doctest: +SKIP
    >>> model.prefix_cache.stats()["tokens_reused"]                                 # doctest: +SKIP
    412
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from ...errors import BackendError, ContinuumError, KVCacheFullError, SequencesExhaustedError, StaleWindowError
from ..seqprefix import common_prefix
from .seqkv import SeqKV
from .sequences import KVView

if TYPE_CHECKING:
    from ...state import SequenceState

__all__ = ["DonorCache"]


class DonorCache:
    """Donor sequences of earlier calls' prompts on one llama.cpp model (see the module docstring).

    Args:
        model: the :class:`~.backend.LlamaCpp` model.
        max_bytes: the budget over the donors' positions.
        max_donors: the most donors kept (each holds a sequence id while resident).
        min_tokens: prompts shorter than this are not kept.
    """

    def __init__(self, model: Any, max_bytes: int, max_donors: int = 16, min_tokens: int = 8):
        self.model, self.max_bytes = model, int(max_bytes)
        self.max_donors, self.min_tokens = max(1, int(max_donors)), max(1, int(min_tokens))
        self.per_token = max(1, int(model.kv_bytes_per_token))
        self._lock = threading.Lock()
        self._donors: OrderedDict[tuple[int, ...], KVView] = OrderedDict()  # least recently used first
        self._counts = dict(hits=0, misses=0, tokens_reused=0, evictions=0)

    def __repr__(self) -> str:
        s = self.stats()
        return f"DonorCache({s['entries']} donors, {s['bytes'] / 2**20:.1f} of {s['max_bytes'] / 2**20:.1f} MiB)"

    def stats(self) -> dict:
        """``hits``/``misses`` (rows looked up), ``tokens_reused``, ``bytes`` (the donors' positions),
        ``max_bytes``, ``entries`` (donors), ``evictions``."""
        with self._lock:
            return dict(self._counts, bytes=self._bytes(), max_bytes=self.max_bytes, entries=len(self._donors))

    def _bytes(self) -> int:
        return self.per_token * sum(len(t) for t in self._donors)

    def clear(self) -> None:
        """Release every donor (states that took cells from one keep them: the cells are shared)."""
        with self._lock:
            for view in self._donors.values():
                view.release()
            self._donors.clear()

    # -- what the decoding loop calls -------------------------------------------------------------------------
    def reuse(self, state: SequenceState, room: int = 0) -> SequenceState:
        """``state`` with each row's KV extended by the longest donor prefix of its tokens (its last token
        excluded), rows laid out as [cached | the rest]; ``state`` itself when nothing is reused."""
        real, own = state._real_rows(), state._cached_real()
        hits: dict[int, KVView] = {}
        with self._lock:
            for r, (toks, _) in enumerate(real):
                best, k = None, 0
                for key in self._donors:
                    n = common_prefix(key, toks[:-1])
                    if n > k:
                        best, k = key, n
                if best is None or k <= own[r] or k < self.min_tokens:
                    self._counts["misses"] += 1
                    continue
                self._donors.move_to_end(best)
                try:
                    view = self.model.pool.fork(self._donors[best], k)  # seq_cp: shared cells
                except (KVCacheFullError, SequencesExhaustedError, StaleWindowError):
                    # a spilled donor with no room to restore it now (the cells are a running step's): computing the
                    # prefix is what the call does without the cache, admitted when it fits (the long oracle: "no
                    # room to restore a spilled state of 70 tokens" raised from a call's setup on 256 cells)
                    self._counts["misses"] += 1
                    continue
                if not self.model.pool.can_extend(view):  # a sliding window already past k: compute it instead
                    view.release()
                    self._counts["misses"] += 1
                    continue
                hits[r] = view
                self._counts["hits"] += 1
                self._counts["tokens_reused"] += k - own[r]
        return _relayout(state, hits) if hits else state

    def remember(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, kv: Any, owner: int | None = None) -> None:
        """Keep each distinct row's computed prompt (``kv`` covers the first ``length`` columns) as a donor."""
        if not isinstance(kv, SeqKV) or self.max_bytes < self.per_token * self.min_tokens:
            return
        L = kv.length()
        with self._lock:
            for r, view in enumerate(kv.views):
                toks = tuple(ids[r, :L][kv.cols[r].to(ids.device)].tolist())
                if len(toks) < self.min_tokens or view.n_tokens != len(toks) or self._covered(toks):
                    continue
                try:
                    donor = view.fork()
                except (BackendError, ContinuumError):  # no sequence id to spare: keep nothing
                    continue
                for key in [k for k in self._donors if toks[:len(k)] == k]:  # what this donor extends
                    self._donors.pop(key).release()
                self._donors[toks] = donor
                self._make_room()

    def settle(self, owner: int | None = None) -> None:
        """Nothing to settle: donors are kept when a prefill ends (no in-flight prefixes are tracked)."""

    # -- internals ----------------------------------------------------------------------------------------------
    def _covered(self, toks: tuple[int, ...]) -> bool:
        for key in self._donors:
            if key[:len(toks)] == toks:
                self._donors.move_to_end(key)
                return True
        return False

    def _make_room(self) -> None:
        while self._donors and (len(self._donors) > self.max_donors or self._bytes() > self.max_bytes):
            _, view = self._donors.popitem(last=False)
            view.release()
            self._counts["evictions"] += 1


def _relayout(state: SequenceState, hits: dict[int, KVView]) -> SequenceState:
    """The state with every row laid out as [its cached tokens | the rest], both parts right-aligned: hit rows
    cached to their donor's ``k``, the others keeping their own view (holes dropped: a llama.cpp view needs none)."""
    from ...state import SequenceState

    real, own = state._real_rows(), state._cached_real()
    kv = state._kv
    views = [hits[r] if r in hits else (kv.views[r] if kv is not None and own[r] else None) for r in range(state.rows)]
    cached = [v.n_tokens if v is not None else 0 for v in views]
    width = max(cached)
    total = width + max(len(toks) - c for (toks, _), c in zip(real, cached))
    R, dev, pad = state.rows, state._ids.device, state._model.tokenizer.pad_token_id
    ids = torch.full((R, total), pad, dtype=state._ids.dtype, device=dev)
    mask = torch.zeros((R, total), dtype=state._mask.dtype, device=dev)
    lp = torch.full((R, total), float("nan"), dtype=state._logprobs.dtype, device=dev)
    for r, ((toks, lps), h) in enumerate(zip(real, cached)):
        t = len(toks) - h
        ids[r, width - h:width] = torch.tensor(toks[:h], dtype=ids.dtype)
        ids[r, total - t:] = torch.tensor(toks[h:], dtype=ids.dtype)
        mask[r, width - h:width] = mask[r, total - t:] = 1
        lp[r, width - h:width] = torch.tensor(lps[:h], dtype=lp.dtype)
        lp[r, total - t:] = torch.tensor(lps[h:], dtype=lp.dtype)
    pool = state._model.pool
    new_kv = SeqKV([v if v is not None else pool.empty() for v in views], mask[:, :width].bool().cpu()) if width else None
    return SequenceState(model=state._model, ids=ids, mask=mask, logprobs=lp, weights=state._weights, kv=new_kv,
                         batch=state.batch, samples=state.samples, last=state._last)
