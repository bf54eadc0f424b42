"""Speculation inside a call's loop (a mixin of :class:`~continuum.loop.steps.CallLoop`): the drafts a step appends
(:meth:`Speculating._draft`, from the call's :class:`~continuum.speculate.Speculator`) and their verification against
the logits the block's forward computed at each drafted position (:meth:`Speculating._verify`): a draft is kept while
the sampler's own draw equals it, so the result is what decoding without drafts would have drawn."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..guides import DEAD, Guide
from ..models import kv as kvcache
from ..speculate import Speculator
from .rows import Rows

__all__ = ["Speculating"]


class Speculating:
    """The speculation half of the loop (its attributes are the loop's, set in ``CallLoop.__init__``)."""

    rows: Rows
    guide: Guide | None
    spec: Speculator | None
    drafts: list[list[int]] | None
    block: torch.Tensor | None
    k: int
    rest: int
    pause: int
    stats: dict
    col: int
    steps: int
    eos: Any
    pad: int
    remask: bool
    tokenizer: Any

    def _draw(self, logprobs: torch.Tensor, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        raise NotImplementedError

    def _masked_logprobs(self, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _verify(self) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """Speculation: walk each row's drafted tokens with the logits the block computed at their positions. At
        position ``i`` the sampler draws from the row's masked log-probs (the guide advanced over the drafts kept so
        far); the draft's token is kept while the draw equals it, and the first draw that differs (or the one after
        the last draft) is the row's token of this step. Kept drafts are accepted into the row (guide, text, stop
        strings, weights); the others' columns become holes and their KV is cut."""
        rows, drafts, block = self.rows, self.drafts, self.block
        assert drafts is not None and block is not None
        self.drafts = self.block = None
        R, width = block.shape[0], block.shape[1]
        cols = [self.col - width + (width - 1 - len(d)) for d in drafts]  # each row's column before its first draft
        kept = [0] * R
        accepted = 0
        decided: list[bool] = list(rows.finished)
        final_ids, final_lp = torch.zeros(R, dtype=torch.long), torch.zeros(R)
        for i in range(max(map(len, drafts)) + 1):
            at = torch.tensor([width - 1 - len(d) + min(i, len(d)) for d in drafts])
            drawn = self._draw(*self._masked_logprobs(block[torch.arange(R), at]))
            if drawn is None:
                break
            ids, lp, reordered = drawn
            assert not reordered, "speculation runs only where the sampler keeps its rows (not beams, not a fork)"
            for r, (t, x) in enumerate(zip(ids.tolist(), lp.tolist())):
                if decided[r] or rows.finished[r]:
                    decided[r] = True
                    continue
                if i < len(drafts[r]) and t == drafts[r][i] and x != -math.inf:
                    kept[r] += 1  # (its column stays, as a sampled token's would)
                    c = cols[r] + 1 + i
                    rows.lp[r, c] = x
                    rows.weights[r] += x
                    ok = rows.accept(r, t)
                    accepted += ok  # (counted once the row took it: a guide that refuses it ends the row instead)
                    if not ok or rows.finished[r]:  # a stop string or the guide ended it
                        decided[r] = True
                else:
                    final_ids[r], final_lp[r], decided[r] = t, x, True
            if all(decided):
                break
        drafted = sum(map(len, drafts))
        self.stats["drafted"] += drafted
        self.stats["accepted"] += accepted
        holes = [(r, cols[r] + 1 + kept[r], cols[r] + 1 + len(d)) for r, d in enumerate(drafts) if kept[r] < len(d)]
        for r, a, b in holes:
            rows.ids[r, a:b], rows.mask[r, a:b], rows.lp[r, a:b] = self.pad, 0, float("nan")
        if holes:  # (llama.cpp: each row's view cut to what it kept; transformers attends by the mask, and the
            rows.kv = kvcache.keep(rows.kv, rows.mask[:, :kvcache.length(rows.kv)])  # engine's merged storage
            self.remask = True  # keeps its own copy of the cached mask: the next request says to rewrite it)
        if drafted and self.spec is not None:  # draft longer while drafts are kept, shorter when they are not
            rate = sum(kept) / drafted
            self.k = min(self.spec.max_draft, self.k + 2) if rate >= 0.8 else max(1, self.k // 2) if rate < 0.3 else self.k
            if rate < 0.3 and self.k == 1:  # drafts of one token still mostly rejected: each costs a position in the
                self.pause = min(2 * self.pause or 4, 64)  # forward (on a CPU, Gemma's output layer: half a step),
                self.rest = self.pause  # so pause drafting, longer each time (JSON values rarely repeat their text)
            elif rate >= 0.8:
                self.pause = 0
        if all(rows.finished):
            return None
        for r in range(R):
            if rows.finished[r]:
                final_ids[r], final_lp[r] = self.pad, 0.0
        return final_ids, final_lp, False

    def _draft(self, keep: list[bool], ids: list[int], runs: list[list[int]] | None) -> list[list[int]]:
        """Each live row's draft after its sampled token (none for a row with a forced run: it already computes
        several tokens), cut where the guide refuses a token or after it completes, before any EOS, and within the
        row's ``max_tokens`` and context."""
        rows, guide, spec = self.rows, self.guide, self.spec
        assert spec is not None
        expect = getattr(spec, "expect", None)
        if expect is not None:  # (a draft model keeps one KV per row: room for every row of this call)
            expect(len(ids))
        out: list[list[int]] = []
        for r, t in enumerate(ids):
            limit = int(min(self.k, self.steps - rows.generated[r] - 1, rows.room[r] - 1))  # (room: inf unbounded)
            if not keep[r] or rows.finished[r] or (runs and runs[r]) or limit <= 0:
                out.append([])
                continue
            real = rows.ids[r, :self.col][rows.mask[r, :self.col].bool()]
            history = torch.cat([real.cpu(), torch.tensor([t])]).numpy()
            state = rows.guide_states[r] if rows.guide_states is not None else None  # (the row's own: a speculator
            d = spec.draft(history, limit, guide=guide, state=state, stats=self.stats,  # that walks it copies it)
                           tokenizer=self.tokenizer)
            cut = next((j for j, x in enumerate(d) if x in self.eos), len(d))
            d = d[:cut]
            if d and guide is not None and rows.guide_states is not None:
                state = guide.copy(rows.guide_states[r])
                for j, x in enumerate(d):
                    state = guide.advance(state, x)
                    if state is DEAD:
                        d = d[:j]
                        break
                    if guide.is_done(state):
                        d = d[:j + 1]
                        break
            out.append(d)
        return out
