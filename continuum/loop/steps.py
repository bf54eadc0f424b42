"""One call's decoding steps, after its setup (:func:`continuum.loop.decoding.decode`): the requests it hands the
engine and its two kinds of step.

* :meth:`CallLoop.common_step`: greedy, no guide, no row ending on EOS: the previous request's top-1 ids and
  log-probs arrive as lists (the engine computed them for every row of the step at once), one column, every row
  real; nothing here touches a tensor of the vocabulary's width.
* :meth:`CallLoop.sampled_step`: every other step: log-softmax, classifier-free guidance, the guide's masks and
  token healing, the sampler (which may reorder rows: beams), end of rows, and the tokens the guide forces after a
  sampled one (fast-forward, computed in the same next forward).

Both are generators: a :class:`~continuum.models.request.Request` is yielded wherever the model is needed (the
engine resumes the loop with it run, merged with every running call's), a
:class:`~continuum.loop.decoding.Step` after each step when the call is streamed.

Example:
    >>> loop = CallLoop(rows, sampler, guide=None, rng=None, steps=20, exhausted="length", eos={2}, pad=0)  # doctest: +SKIP
    >>> fed, group = yield from loop.run(model, C, owner)                                                 # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from typing import Any

import torch

from ..errors import StaleWindowError
from ..guides import Guide
from ..models import kv as kvcache
from ..models.kv import positions
from ..models.request import Request
from ..samplers import GreedySampler, Sampler
from ..speculate import Speculator
from .cancel import check_cancelled
from .fastforward import forced_runs, run_logprobs
from .healing import apply_heal_masks
from .rows import Rows
from .speculating import Speculating

__all__ = ["CallLoop"]


class CallLoop(Speculating):
    """The steps of one call (see the module docstring); the state it carries between them.

    Attributes:
        rows: every per-row buffer (:class:`~continuum.loop.rows.Rows`: reordered in one place).
        col: the next column to write; ``fed``: the columns whose KV the last forward computed.
        group: samples per prompt now (a sampler that forks or reorders sets it to its own count).
        last: the last request handed to the engine (its ``top`` lists feed the common step).
    """

    def __init__(self, rows: Rows, sampler: Sampler, *, guide: Guide | None, rng: torch.Generator | None, steps: int,
                 group: int, exhausted: str, eos: frozenset, pad: int, fast_forward: bool, track_text: bool,
                 step: Callable[[Rows, bool], Any], speculate: Speculator | None = None):
        self.rows, self.sampler, self.guide, self.rng = rows, sampler, guide, rng
        self.steps, self.group, self.exhausted, self.eos, self.pad = steps, group, exhausted, eos, pad
        self.ff = fast_forward and guide is not None and rows.branch is None
        self.spec = speculate if rows.branch is None else None  # (guidance's branch decodes one column per step)
        self.lists = guide is None and rows.branch is None and type(sampler) is GreedySampler
        self.drafts: list[list[int]] | None = None  # each row's drafted tokens in the last block (not yet accepted)
        self.block: torch.Tensor | None = None  # that block's logits, (rows, width, vocab), for verification
        self.k = speculate.max_draft if speculate is not None else 0  # the draft length now (adapted to acceptance)
        self.rest, self.pause = 0, 0  # steps left without drafting, and the next pause's length (drafts kept rarely)
        self.stats = {"forwards": 0, "drafted": 0, "accepted": 0}
        self.remask = False  # the next request's cached mask lost columns (rejected drafts): see Request.remask
        self.engine: Any = None  # the model's engine (run): how many calls share its steps
        self.tokenizer: Any = None  # the model's tokenizer (run)
        self.track_text, self._chunk = track_text, step
        self.W = rows.width
        self.col = self.fed = self.W
        self.last: Request | None = None
        self.logits: torch.Tensor | None = None
        self.reals: list[int] | None = None  # real tokens per row before the current column (common steps)

    # -- requests -------------------------------------------------------------------------------------------
    def _reserve(self, end: int) -> int:
        """Columns the call may still append after a forward ending at column ``end`` (its remaining steps, capped):
        a backend that preallocates KV storage makes room once."""
        return max(0, min(self.W + self.steps - end, kvcache.RESERVE_CAP))

    def forward(self, start: int, end: int, logits: str = "last"):
        """The model on columns [start, end): a request the engine runs in its next step (merged with every running
        call's); with guidance, the branch's requests (both branches: :class:`~continuum.loop.cfg.UnconditionalBranch`)."""
        rows = self.rows
        mask = rows.mask[:, :end]
        if end - start == 1:  # one column: positions(mask)[:, -1:] without the cumsum (a pad column of a row
            pos = (mask.sum(1, keepdim=True) - 1).clamp(min=0)  # finished at its context limit stays in range)
        else:
            pos = positions(mask)[:, start:]
        reserve = self._reserve(end)  # columns to come: KV storage once
        if rows.branch is not None:  # guidance: runs both branches
            self.last = None
            return (yield from rows.branch.forward(rows.ids[:, start:end], mask, pos, rows.kv, logits=logits,
                                                   reserve=reserve))
        req = self.last = Request(rows.ids[:, start:end], mask, pos, rows.kv, logits, reserve, normalize=True,
                                  remask=self.remask)
        self.remask = False
        try:
            yield req
        except StaleWindowError:  # a sliding window's cells gone (models/llamacpp/window.py): every row again from 0
            if start == 0:
                raise
            rows.kv = None
            lg, rows.kv = yield from self.forward(0, end, logits)
            return (lg[:, start:] if logits == "all" else lg), rows.kv
        result, req.result = req.result, None  # (``last`` is kept for its top lists: a KV view held there would keep
        return result  # a dead tail of rejected drafts alive, which a spill then writes the window behind)

    def column_forward(self, col: int, ids: list[int], pos: list[int]):
        """:meth:`forward` on the one column ``col`` in which every row is real, as lists (the engine's common
        step: it builds the batch's tensors at once; ``source`` makes this call's if needed)."""
        rows = self.rows

        def source():
            rows.flush()
            mask = rows.mask[:, :col + 1]
            return rows.ids[:, col:col + 1], mask, (mask.sum(1, keepdim=True) - 1).clamp(min=0)

        reserve = self._reserve(col + 1)
        req = self.last = Request(None, None, None, rows.kv, "last", reserve, normalize=True,  # type: ignore[arg-type]
                                  column=(ids, pos), source=source)
        yield req
        result, req.result = req.result, None  # (see forward)
        return result

    # -- the call ---------------------------------------------------------------------------------------------
    def run(self, model: Any, C: int, owner: int) -> Generator[Any, Any, tuple[int, int]]:
        """Prefill columns [C, W) (a long prompt in chunks while other calls run, so their next tokens do not wait),
        then step until every row ended. Returns ``(fed, group)`` for the result state."""
        rows = self.rows
        self.engine = model.engine
        self.tokenizer = getattr(model, "tokenizer", None)  # (speculation: the lookup drafts by text too)
        try:  # (a row whose window went while the call waited for admission: forward recomputes every row)
            yield from self._prefill(model, C)
        except StaleWindowError:  # (in a chunk: the whole prefill again, from the start)
            rows.kv = None
            yield from self._prefill(model, 0)
        if getattr(model, "prefix_cache", None) is not None:  # what this prefill computed, for later calls
            model.prefix_cache.remember(model, rows.ids, rows.mask, rows.kv, owner)
        while True:
            check_cancelled(rows.finished.count(False))  # Ctrl-C / a closed stream: stop between two forwards
            common = yield from (self.common_step() if self._common() else self.sampled_step())
            if common:
                break
        return self.fed, self.group

    def _prefill(self, model: Any, start: int):
        rows = self.rows
        chunk = model.engine.chunk_for(self.W - start) if rows.branch is None else None
        while chunk and self.W - start > chunk:
            _, rows.kv = yield from self.forward(start, start + chunk, logits="none")
            start += chunk
        self.logits, rows.kv = yield from self.forward(start, self.W)

    def _busy(self) -> bool:
        """Speculation rests while more than ``max_calls`` calls share the step (compute-bound: see speculate.py)."""
        return self.spec is not None and self.engine is not None and self.engine.running_hint > self.spec.max_calls

    def _resting(self) -> bool:
        """Drafting paused after drafts were rejected at the shortest length (counts the steps down)."""
        if self.rest > 0:
            self.rest -= 1
            return True
        return False

    def _common(self) -> bool:
        top = self.last.top if self.last is not None else None
        rows = self.rows
        return self.lists and top is not None and not any(rows.finished) and self.eos.isdisjoint(top[0]) \
            and all(h is None for h in rows.heal) and self.drafts is None and (self.spec is None or self._busy() or self.rest > 0)

    def common_step(self):
        """Greedy, no guide, no row ends on EOS: the engine's top-1 lists, one column. Returns True when done."""
        rows = self.rows
        id_list, lp_list = self.last.top
        self.rest = max(0, self.rest - 1)  # (a paused speculation rests on this step too)
        for r, t in enumerate(id_list):
            rows.accept(r, t)  # (no guide: always kept; a stop string may end the row after it)
        rows.queue_column(id_list, lp_list)
        rows.end_exhausted(self.steps, self.exhausted)
        if self.track_text:  # (a stream's chunk)
            yield self._chunk(rows, False)
        if all(rows.finished):
            return True
        if self.reals is None:
            rows.flush()
            self.reals = rows.mask[:, :self.col].sum(1).tolist()
        pos, self.reals = self.reals, [x + 1 for x in self.reals]
        self.logits, rows.kv = yield from self.column_forward(self.col, id_list, pos)
        self.stats["forwards"] += 1
        self.col = self.fed = self.col + 1
        return False

    def _masked_logprobs(self, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs, raw)``: the step's log-probs after guidance, the guide's masks and healing (rows the guide
        completed are ended here), and the model's own (the weights). ``logits`` None: the last request's (its
        log-probs when the engine normalized them); else these (a drafted position's, speculation)."""
        rows, guide, last = self.rows, self.guide, self.last
        if logits is None and last is not None and last.top is not None:
            logprobs = raw = last.log_probs()
        else:
            logprobs = raw = torch.log_softmax(self.logits if logits is None else logits, dim=-1)  # type: ignore[arg-type]
        if rows.branch is not None:  # guidance before sampling and masks; the weights stay the raw log-probs
            logprobs = rows.branch.guide(raw)
        if guide is not None:  # healed rows: their first token is masked by the heal plan instead
            assert rows.guide_states is not None  # a guide gives every row a state
            for r, s in enumerate(rows.guide_states):
                if not rows.finished[r] and rows.heal[r] is None and guide.is_done(s):
                    rows.finished[r] = rows.complete[r] = True
                    rows.reason[r] = "pattern"
            logprobs = guide.apply_mask(logprobs, [None if f or h else s for f, h, s in
                                                   zip(rows.finished, rows.heal, rows.guide_states)])
        if any(h is not None for h in rows.heal):
            logprobs = apply_heal_masks(logprobs, rows.heal)
        return logprobs, raw

    def _draw(self, logprobs: torch.Tensor, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """The sampler on the masked log-probs: ``(ids, their log-probs, reordered)``; rows follow their ancestors
        (:meth:`Rows.reorder`). None when every row has ended."""
        rows, sampler = self.rows, self.sampler
        if all(rows.finished):
            return None
        if any(rows.finished):
            done = torch.tensor(rows.finished, device=logprobs.device)
            logprobs = logprobs.masked_fill(done[:, None], float("-inf"))
            logprobs[done, self.pad] = 0.0
        ids, ancestors, rows.scores = sampler(logprobs, rows.scores, self.group, self.rng)
        reordered = sampler.reorders(self.group)
        if reordered:
            rows.reorder(ancestors)
            self.group = sampler.samples
        step_lp = logprobs[ancestors, ids]
        if rows.branch is not None:  # -inf still marks a dead beam
            step_lp = torch.where(step_lp == -math.inf, step_lp, raw[ancestors, ids])
        return ids, step_lp, reordered

    def sampled_step(self):
        """Any other step: mask, sample, reorder, end rows, fast-forward. Returns True when every row ended."""
        rows, guide = self.rows, self.guide
        rows.flush()
        self.reals = None
        healing = any(h is not None for h in rows.heal)
        drawn = self._verify() if self.drafts is not None else self._draw(*self._masked_logprobs())
        if drawn is None:
            return True
        ids, step_lp, reordered = drawn
        id_list, lp_list = ids.tolist(), step_lp.tolist()
        keep = [False] * len(id_list)
        for r, (t, lp) in enumerate(zip(id_list, lp_list)):
            if rows.finished[r]:
                continue
            if t in self.eos or lp == -math.inf:
                rows.finished[r] = True
                if lp == -math.inf:  # a beam with no allowed continuation: dead
                    rows.weights[r] = -math.inf
                elif rows.guide_states is not None and guide is not None:
                    rows.complete[r] = guide.is_final(rows.guide_states[r])
                rows.reason[r] = "pattern" if guide is not None and rows.complete[r] else "eos"
                continue
            keep[r] = rows.accept(r, t)
        if healing:
            rows.heal = [None] * len(keep)
        runs = self._forced(keep) if self.ff else None
        drafts = self._draft(keep, id_list, runs) if self.spec is not None and not self._busy() and not self._resting() \
            else None
        if drafts is not None and not any(drafts):
            drafts = None
        block = [(f or []) + d for f, d in zip(runs or [[]] * len(keep), drafts or [[]] * len(keep))] \
            if drafts is not None else runs
        col, width = self.col, 1 + max(map(len, block)) if block else 1
        rows.ensure(col + width)
        if width == 1 and all(keep):  # the common step's layout: one column, every row real
            rows.ids[:, col], rows.mask[:, col], rows.lp[:, col] = ids, 1, step_lp
            rows.weights += torch.tensor(lp_list)
            rows.width = col + 1
        else:
            rows.write_block(col, id_list, lp_list, keep, block or [[]] * len(keep), width)
        rows.end_exhausted(self.steps, self.exhausted)
        if self.track_text:  # (a stream's chunk)
            yield self._chunk(rows, reordered)
        if all(rows.finished):
            if runs:  # the forced tokens' log-probs: every column but the last (which stays uncached)
                out, rows.kv = yield from self.forward(col, col + width - 1, logits="all")
                rows.add_forced_logprobs(col, width, runs, run_logprobs(out, runs, width))
                self.fed = col + width - 1
            return True
        self.logits, rows.kv = yield from self.forward(col, col + width, logits="all" if block else "last")
        self.stats["forwards"] += 1
        if runs:
            rows.add_forced_logprobs(col, width, runs, run_logprobs(self.logits, runs, width))
        if drafts is not None:
            self.drafts, self.block = drafts, self.logits
        if block:
            self.logits = self.logits[:, -1]
        self.col = self.fed = col + width
        return False

    def _forced(self, keep: list[bool]) -> list[list[int]] | None:
        """The forced run of every row after its sampled token, each already accepted by the row (a run stops early
        where a stop string ends the row); ``None`` when no row has one."""
        rows = self.rows
        live = [k and not f for k, f in zip(keep, rows.finished)]
        budget = [min(self.steps - g, room) for g, room in zip(rows.generated, rows.room)]
        assert rows.guide_states is not None  # fast-forward runs only with a guide
        runs = forced_runs(rows.guide, rows.guide_states, live, budget, self.group, self.sampler.is_beam_search)
        for r, run in enumerate(runs):
            for i, t in enumerate(run):
                if not rows.accept(r, t):
                    del run[i:]
                    break
                rows.forced[r] += (rows.generated[r] - 1,)  # a tuple, rebound: beam heirs never share it
                if rows.finished[r]:
                    del run[i + 1:]
                    break
        return runs if any(runs) else None
