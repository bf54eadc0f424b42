"""Per-row decoding state: ids, masks, log-probs, weights, KV rows, guide states, stop and heal
bookkeeping. :meth:`Rows.reorder` is the ONE place where rows follow their ancestors (forks, beam
search), classifier-free guidance's unconditional rows included.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..guides import DEAD, Guide
from ..models import kv as kvcache
from ..state import SequenceState
from ..state.text import detokenizer
from .cfg import UnconditionalBranch
from .checks import PREALLOCATED
from .healing import Heal

__all__ = ["Rows"]


class Rows:
    """All per-row decoding state. :meth:`reorder` is the ONE place rows follow their ancestors."""

    branch: UnconditionalBranch | None = None  # classifier-free guidance's unconditional branch: its rows follow too

    def __init__(self, state: SequenceState, capacity: int, guide: Guide | None, track_text: bool, stops: list[str],
                 heals: list[Heal | None] | None = None):
        R, L = state._ids.shape
        dev = state._ids.device
        self.pad = state._model.tokenizer.pad_token_id
        # ``capacity`` is the most tokens the call may add: with max_tokens=None the rest of the context (2**31
        # where it is unbounded), so only a bounded part is allocated now
        extra = min(capacity, PREALLOCATED)
        self.ids = torch.cat([state._ids, state._ids.new_full((R, extra), self.pad)], 1)
        self.mask = torch.cat([state._mask, state._mask.new_zeros((R, extra))], 1)
        lp = state._logprobs.to(torch.float32)
        self.lp = torch.cat([lp, lp.new_full((R, extra), float("nan"))], 1)
        self.width = L
        self.queued: list[tuple[list[int], list[float]]] = []  # decode columns not yet in the tensors (flush)
        self.kv = state._kv
        self.weights = state._weights.detach().to("cpu", torch.float32).clone()  # per-row sums live on the CPU
        self.scores = self.weights.to(dev)  # what beam search ranks by, next to the logits
        self.finished = [False] * R
        self.complete = [guide is None] * R
        self.stop_cut: list[int | None] = [None] * R
        self.generated = [0] * R  # tokens appended per row (sampled and forced): max_tokens counts both
        self.forced: list[tuple[int, ...]] = [()] * R  # ordinals (in generated) of fast-forwarded tokens
        self.reason: list[str | None] = [None] * R  # why each row finished (LastStep.finish)
        ctx = state._model.context_length  # tokens each row may still add before its own context limit
        self.room: list = [ctx - n for n in state._real_lengths()] if ctx is not None else [math.inf] * R
        self.stops = stops
        self.heal = list(heals) if heals is not None else [None] * R  # token healing: the first token's plan
        self.heal_chars = [h.chars if h is not None else 0 for h in self.heal]  # removed text: not output
        self.resumed = [False] * R
        self.guide = guide
        self.guide_states: list[Any] | None = [guide.new_state() for _ in range(R)] if guide is not None else None
        texts = state.texts
        self.start_chars = [len(t) for t in texts]
        last = state._last
        if guide is not None and last is not None and last.guide_key == guide.key and last.guide_states is not None:
            for r, (done, gs) in enumerate(zip(last.complete, last.guide_states)):
                if not done and gs is not None:  # resume the unfinished constrained step (on a copy: the
                    # input state keeps its own, and a stateful engine advances states in place)
                    assert self.guide_states is not None  # built above: there is a guide
                    self.guide_states[r], self.start_chars[r] = guide.copy(gs), last.starts[r]
                    self.resumed[r] = True
        real = state._real_rows() if track_text else None
        self.detoks = [detokenizer(state._model.tokenizer, real[r][0]) for r in range(R)] if real is not None else None

    def queue_column(self, ids: list[int], lps: list[float]) -> None:
        """Append a decode column in which every row is real (the engine's common step), as lists: written
        into the tensors by :meth:`flush`, once, when something reads them."""
        self.queued.append((ids, lps))
        self.width += 1

    def flush(self) -> None:
        """Write the queued columns into ``ids``, ``mask``, ``lp`` and ``weights``."""
        if not self.queued:
            return
        k, dev = len(self.queued), self.ids.device
        start = self.width - k
        self.ensure(self.width)
        if k == 1:  # (the common case, a call's last column: as vectors, a transpose and a sum fewer)
            (id_list, lp_list), = self.queued
            ids, lps = torch.tensor(id_list, dtype=torch.long), torch.tensor(lp_list, dtype=torch.float32)
            self.queued = []
            # (select + copy_: the same writes as ``[:, start] =`` without the indexing machinery, a few us a call)
            self.ids.select(1, start).copy_(ids)
            self.mask.select(1, start).fill_(1)
            self.lp.select(1, start).copy_(lps)
            self.weights += lps
            return
        ids = torch.tensor([c[0] for c in self.queued], dtype=torch.long).T
        lps = torch.tensor([c[1] for c in self.queued], dtype=torch.float32).T
        self.queued = []
        self.ids[:, start:self.width] = ids.to(dev)
        self.mask[:, start:self.width] = 1
        self.lp[:, start:self.width] = lps.to(dev)
        self.weights += lps.sum(1)

    def end(self, r: int, reason: str) -> None:
        """Finish row ``r`` for ``reason``; a row cut just as its constraint completed counts as "pattern"."""
        gs = self.guide_states[r] if self.guide_states is not None else None
        done = gs is not None and self.guide is not None and self.guide.is_done(gs)  # guide states come with a guide
        self.finished[r], self.reason[r] = True, "pattern" if done else reason

    def end_exhausted(self, steps: int, exhausted: str) -> None:
        """End the rows that reached ``max_tokens`` (``steps``: for ``exhausted``) or their own context."""
        for r, g in enumerate(self.generated):
            if not self.finished[r] and (g >= steps or self.room[r] <= 0):
                self.end(r, exhausted if g >= steps else "context")

    def step_texts(self) -> list[str] | None:
        """Every row's generated text so far (held back where a character is incomplete), when tracked."""
        if self.detoks is None:
            return None
        return [d.stable_text()[h:] for d, h in zip(self.detoks, self.heal_chars)]

    def reorder(self, ancestors: torch.Tensor) -> None:
        self.flush()
        idx = ancestors.tolist()
        a = ancestors.to(self.ids.device)
        self.ids, self.mask, self.lp = self.ids.index_select(0, a), self.mask.index_select(0, a), self.lp.index_select(0, a)
        self.kv = kvcache.select_rows(self.kv, ancestors) if self.branch is None else self.branch.reorder(ancestors, self.kv)
        self.weights = self.weights.index_select(0, ancestors.cpu())
        for name in ("finished", "complete", "stop_cut", "reason", "room", "start_chars", "generated", "forced", "heal",
                     "heal_chars", "resumed"):
            setattr(self, name, [getattr(self, name)[i] for i in idx])
        if self.guide_states is not None and self.guide is not None:  # guide states come with a guide
            states, guide = self.guide_states, self.guide
            if guide.copy_free:
                self.guide_states = [states[i] for i in idx]
            else:  # a row owns its state: the first heir of a row takes it, later ones get copies
                seen: set[int] = set()
                heirs = []
                for i in idx:
                    heirs.append(guide.copy(states[i]) if i in seen else states[i])
                    seen.add(i)
                self.guide_states = heirs
        if self.detoks is not None:
            self.detoks = [self.detoks[i].copy() for i in idx]

    def accept(self, r: int, token: int) -> bool:
        """Advance row ``r``'s guide and text by ``token`` (sampled or forced); False when the guide
        refuses it (the row ends, incomplete). A stop string ends the row after the token."""
        if self.guide_states is not None and self.guide is not None:  # guide states come with a guide
            plan, guide = self.heal[r], self.guide  # a healed first token: the guide walked the text after the removed one
            self.guide_states[r] = plan.state_after(guide, token) if plan else guide.advance(self.guide_states[r], token)
            if self.guide_states[r] is DEAD:  # the engine refused a token its mask allowed
                self.finished[r], self.complete[r] = True, False
                return False
            self.complete[r] = guide.is_final(self.guide_states[r])
        self.generated[r] += 1
        self.room[r] -= 1
        if self.detoks is not None:
            before = len(self.detoks[r].text)
            text = self.detoks[r].push(token)
            for s in self.stops:
                at = text.find(s, max(self.heal_chars[r], before - len(s) + 1))
                cut = self.stop_cut[r]
                if at >= 0 and (cut is None or at + len(s) < cut):
                    self.stop_cut[r] = at + len(s)
            if self.stop_cut[r] is not None:
                self.finished[r], self.reason[r] = True, "stop"
        return True

    def ensure(self, width: int) -> None:
        """Room for ``width`` columns: generated tokens beyond the columns allocated up front, and forced runs of
        rows of different lengths (extra columns). Grows by half at least, so a long call copies its columns
        a few times, not once per token."""
        have = self.ids.shape[1]
        if width <= have:
            return
        extra = max(width - have, have // 2)
        self.ids = torch.cat([self.ids, self.ids.new_full((self.ids.shape[0], extra), self.pad)], 1)
        self.mask = torch.cat([self.mask, self.mask.new_zeros((self.mask.shape[0], extra))], 1)
        self.lp = torch.cat([self.lp, self.lp.new_full((self.lp.shape[0], extra), float("nan"))], 1)

    def write_block(self, col: int, ids: list[int], lps: list[float], keep: list[bool], runs: list[list[int]],
                    width: int) -> None:
        """Write each kept row's sampled token and forced run right-aligned in columns
        ``[col, col + width)`` (holes before it); forced log-probs are filled in after the forward."""
        R = len(ids)
        pad = self.pad
        blk_ids = [[pad] * width for _ in range(R)]
        blk_mask = [[0] * width for _ in range(R)]
        blk_lp = [[float("nan")] * width for _ in range(R)]
        for r in range(R):
            if not keep[r]:
                continue
            first = width - 1 - len(runs[r])
            blk_ids[r][first:] = [ids[r]] + runs[r]
            blk_mask[r][first:] = [1] * (1 + len(runs[r]))
            blk_lp[r][first] = lps[r]
        dev = self.ids.device
        self.ids[:, col:col + width] = torch.tensor(blk_ids, device=dev)
        self.mask[:, col:col + width] = torch.tensor(blk_mask, device=dev, dtype=self.mask.dtype)
        self.lp[:, col:col + width] = torch.tensor(blk_lp, device=dev)
        self.weights += torch.tensor([lp if k else 0.0 for lp, k in zip(lps, keep)])
        self.width = col + width

    def add_forced_logprobs(self, col: int, width: int, runs: list[list[int]], lps: list[list[float]]) -> None:
        """Record the forced runs' raw log-probs: token columns, weights, and the beam scores."""
        sums = []
        for r, (run, lp) in enumerate(zip(runs, lps)):
            if run:
                self.lp[r, col + width - len(run):col + width] = torch.tensor(lp, dtype=self.lp.dtype)
            sums.append(math.fsum(lp))
        add = torch.tensor(sums, dtype=torch.float32)
        self.weights += add
        self.scores = self.scores + add.to(self.scores.device, self.scores.dtype)
