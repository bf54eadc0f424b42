"""The decoding loop: one loop for every generator, from any ``SequenceState``.

::

    state ──▶ prefill the uncached suffix (ONE forward) ──▶ logits
                 ▲                                            │ log-softmax, guide mask
                 │                                            ▼
           forward the new column ◀── append, advance guides ◀── sampler: ids, ancestors, scores
                                      check EOS / stop strings     reorder ALL per-row state (_Rows.reorder)

The loop is a Python generator: it yields a :class:`Step` after every forward pass (streaming reads
them) and returns the final ``SequenceState``. When the guide forces the tokens after a sampled one,
the whole run is appended and computed in the same next forward pass (:mod:`continuum.fastforward`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Generator, Optional

import torch

from . import cache as kvcache
from .errors import ContextLengthError, GeneratorArgumentError, SampleMismatch
from .fastforward import forced_runs, run_logprobs
from .guides import DEAD, Guide
from .healing import Heal, apply_heal_masks, heal
from .samplers import Sampler
from .state import LastStep, SequenceState
from .text import Detokenizer

__all__ = ["decode", "prefill", "Step", "check_max_tokens", "positions"]

_RESERVE_CAP = 1024  # KV columns allocated ahead at most (an open-ended generation grows in chunks)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of every column: the number of real tokens before it (holes do not count)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


@dataclass
class Step:
    """What one decoding step did: the generated text of every row so far (when tracked)."""

    texts: Optional[list[str]]
    reordered: bool


def check_max_tokens(max_tokens: Optional[int]) -> None:
    if max_tokens is None:
        return
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise GeneratorArgumentError(f"max_tokens must be an int or None, got {type(max_tokens).__name__}")
    if max_tokens < 0:
        raise GeneratorArgumentError(f"max_tokens must be >= 0 (0 = prefill only), got {max_tokens}")


def _stop_list(stop_at) -> list[str]:
    if stop_at is None:
        return []
    stops = [stop_at] if isinstance(stop_at, str) else list(stop_at)
    if not all(isinstance(s, str) and s for s in stops):
        raise GeneratorArgumentError(f"stop_at must be a non-empty string or a list of them, got {stop_at!r}")
    return stops


class _Rows:
    """All per-row decoding state. :meth:`reorder` is the ONE place rows follow their ancestors."""

    def __init__(self, state: SequenceState, capacity: int, guide: Optional[Guide], track_text: bool, stops: list[str],
                 heals: Optional[list[Optional[Heal]]] = None):
        R, L = state._ids.shape
        dev = state._ids.device
        self.pad = state._model.tokenizer.pad_token_id
        self.ids = torch.full((R, L + capacity), self.pad, dtype=torch.long, device=dev)
        self.mask = torch.zeros((R, L + capacity), dtype=state._mask.dtype, device=dev)
        self.lp = torch.full((R, L + capacity), float("nan"), dtype=torch.float32, device=dev)
        self.ids[:, :L], self.mask[:, :L], self.lp[:, :L] = state._ids, state._mask, state._logprobs
        self.width = L
        self.kv = state._kv
        self.weights = state._weights.detach().to("cpu", torch.float32).clone()  # per-row sums live on the CPU
        self.scores = self.weights.to(dev)  # what beam search ranks by, next to the logits
        self.finished = [False] * R
        self.complete = [guide is None] * R
        self.stop_cut: list[Optional[int]] = [None] * R
        self.generated = [0] * R  # tokens appended per row (sampled and forced): max_tokens counts both
        self.stops = stops
        self.heal = list(heals) if heals is not None else [None] * R  # token healing: the first token's plan
        self.heal_chars = [h.chars if h is not None else 0 for h in self.heal]  # removed text: not output
        self.resumed = [False] * R
        self.guide = guide
        self.guide_states = [guide.new_state() for _ in range(R)] if guide is not None else None
        texts = state.texts
        self.start_chars = [len(t) for t in texts]
        last = state._last
        if guide is not None and last is not None and last.guide_key == guide.key and last.guide_states is not None:
            for r, (done, gs) in enumerate(zip(last.complete, last.guide_states)):
                if not done and gs is not None:  # resume the unfinished constrained step (on a copy: the
                    # input state keeps its own, and a stateful engine advances states in place)
                    self.guide_states[r], self.start_chars[r] = guide.copy(gs), last.starts[r]
                    self.resumed[r] = True
        real = state._real_rows() if track_text else None
        self.detoks = [Detokenizer(state._model.tokenizer, real[r][0]) for r in range(R)] if track_text else None

    def reorder(self, ancestors: torch.Tensor) -> None:
        idx = ancestors.tolist()
        a = ancestors.to(self.ids.device)
        self.ids, self.mask, self.lp = self.ids.index_select(0, a), self.mask.index_select(0, a), self.lp.index_select(0, a)
        self.kv = kvcache.select_rows(self.kv, ancestors)
        self.weights = self.weights.index_select(0, ancestors.cpu())
        for name in ("finished", "complete", "stop_cut", "start_chars", "generated", "heal", "heal_chars", "resumed"):
            setattr(self, name, [getattr(self, name)[i] for i in idx])
        if self.guide_states is not None:
            states = self.guide_states
            if self.guide.copy_free:
                self.guide_states = [states[i] for i in idx]
            else:  # a row owns its state: the first heir of a row takes it, later ones get copies
                seen: set[int] = set()
                heirs = []
                for i in idx:
                    heirs.append(self.guide.copy(states[i]) if i in seen else states[i])
                    seen.add(i)
                self.guide_states = heirs
        if self.detoks is not None:
            self.detoks = [self.detoks[i].copy() for i in idx]

    def accept(self, r: int, token: int) -> bool:
        """Advance row ``r``'s guide and text by ``token`` (sampled or forced); False when the guide
        refuses it (the row ends, incomplete). A stop string ends the row after the token."""
        if self.guide_states is not None:
            plan = self.heal[r]  # a healed first token: the guide walked the text after the removed one
            self.guide_states[r] = plan.state_after(self.guide, token) if plan else self.guide.advance(self.guide_states[r], token)
            if self.guide_states[r] is DEAD:  # the engine refused a token its mask allowed
                self.finished[r], self.complete[r] = True, False
                return False
            self.complete[r] = self.guide.is_final(self.guide_states[r])
        self.generated[r] += 1
        if self.detoks is not None:
            before = len(self.detoks[r].text)
            text = self.detoks[r].push(token)
            for s in self.stops:
                at = text.find(s, max(self.heal_chars[r], before - len(s) + 1))
                if at >= 0 and (self.stop_cut[r] is None or at + len(s) < self.stop_cut[r]):
                    self.stop_cut[r] = at + len(s)
            if self.stop_cut[r] is not None:
                self.finished[r] = True
        return True

    def ensure(self, width: int) -> None:
        """Room for ``width`` columns (forced runs of rows of different lengths take extra columns)."""
        have = self.ids.shape[1]
        if width <= have:
            return
        extra = max(width - have, have // 2)
        self.ids = torch.cat([self.ids, self.ids.new_full((self.ids.shape[0], extra), self.pad)], 1)
        self.mask = torch.cat([self.mask, self.mask.new_zeros((self.mask.shape[0], extra))], 1)
        self.lp = torch.cat([self.lp, self.lp.new_full((self.lp.shape[0], extra), float("nan"))], 1)

    def write_block(self, col: int, ids: list[int], lps: list[float], keep: list[bool], runs: list[list[int]], width: int) -> None:
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
        self.weights += torch.tensor([l if k else 0.0 for l, k in zip(lps, keep)])
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


def prefill(state: SequenceState) -> SequenceState:
    """Cache everything but each row's last token (one forward pass over the uncached suffix)."""
    C, W = kvcache.length(state._kv), state._ids.shape[1]
    if W - 1 <= C:
        return state
    mask = state._mask[:, :W - 1]
    _, kv = state._model.forward(state._ids[:, C:W - 1], mask, positions(mask)[:, C:], state._kv, logits="none")
    return SequenceState(model=state._model, ids=state._ids, mask=state._mask, logprobs=state._logprobs,
                         weights=state._weights, kv=kv, batch=state.batch, samples=state.samples, last=state._last)


def check_continuable(state: SequenceState, sampler: Sampler, max_tokens: Optional[int]) -> int:
    """Validate ``state`` for ``sampler``; return how many tokens may be generated (context-capped)."""
    group, n = state.samples, sampler.samples
    if group not in (1, n):
        kind = "samplers.beam_search" if sampler.is_beam_search else "samplers.multinomial"
        raise SampleMismatch(
            f"this state has {group} samples per batch row but the generator produces {n}: use a generator with "
            f"{kind}({group}), or select one sample first (state[:, i, :]) and let the generator fork it")
    lengths = state._mask.sum(1)
    if bool((lengths == 0).any()):
        rows = (lengths == 0).nonzero().flatten().tolist()
        raise GeneratorArgumentError(f"row(s) {rows} hold no token: give a non-empty prompt (this tokenizer adds no BOS token)")
    longest = int(lengths.max())
    ctx = state._model.context_length
    if ctx is not None and longest > ctx:
        raise ContextLengthError(f"the input has {longest} tokens but the model's context is {ctx}: cut it, e.g. state[..., -N:]")
    steps = max_tokens if max_tokens is not None else (ctx - longest if ctx is not None else 2**31)
    return min(steps, ctx - longest) if ctx is not None else steps


def decode(
    state: SequenceState,
    sampler: Sampler,
    *,
    guide: Optional[Guide] = None,
    max_tokens: Optional[int] = None,
    stop_at=None,
    rng: Optional[torch.Generator] = None,
    kind: str = "text",
    parse: Optional[Callable[[str], object]] = None,
    track_text: bool = False,
    fast_forward: bool = True,
    token_healing: bool = False,
) -> Generator[Step, None, SequenceState]:
    """Continue ``state`` with ``sampler`` (and ``guide``); yields a :class:`Step` per forward pass, returns the new state.

    ``fast_forward``: append the tokens the guide forces after a sampled token and compute them in
    the same next forward pass (:mod:`continuum.fastforward`); ``max_tokens`` counts them.
    ``token_healing``: back up each row's last token and constrain the first generated token to
    re-cover its text (:mod:`continuum.healing`); the output still starts after the input's text.
    """
    check_max_tokens(max_tokens)
    stops = _stop_list(stop_at)
    steps = check_continuable(state, sampler, max_tokens)
    model, tok = state._model, state._model.tokenizer
    group, n = state.samples, sampler.samples

    if steps == 0:  # prefill only: everything but the last token, which stays uncached
        state = prefill(state)
    rows = _Rows(state, steps, guide, track_text or bool(stops), stops)
    if token_healing and steps > 0:
        state, heals = heal(state, guide, rows.guide_states or [None] * state.rows, rows.resumed)
        if any(h is not None for h in heals):
            rows = _Rows(state, steps, guide, track_text or bool(stops), stops, heals)
    C, W = kvcache.length(rows.kv), rows.width
    eos, pad = tok.eos_token_ids, tok.pad_token_id
    ff = fast_forward and guide is not None

    def forward(start: int, end: int, logits: str = "last"):
        mask = rows.mask[:, :end]
        if end - start == 1:  # one column: its position is the count of real tokens before it
            pos = mask[:, :start].sum(1, keepdim=True)
        else:
            pos = positions(mask)[:, start:]
        reserve = max(0, min(W + steps - end, _RESERVE_CAP))  # the columns still to come: KV storage allocated once
        return model.forward(rows.ids[:, start:end], mask, pos, rows.kv, logits=logits, reserve=reserve)

    if steps == 0:
        if n != group:  # fork: the samples share the prefilled cache
            fork = torch.arange(state.rows).repeat_interleave(n)
            rows.reorder(fork)
            rows.scores = rows.scores.index_select(0, fork.to(rows.scores.device))
        return _finish(state, rows, C, n, guide, kind, parse, max_tokens, sampler)

    logits, rows.kv = forward(C, W)
    fed = col = W
    while True:
        logprobs = torch.log_softmax(logits, dim=-1)
        healing = any(h is not None for h in rows.heal)
        if guide is not None:  # healed rows: their first token is masked by the heal plan instead
            for r, s in enumerate(rows.guide_states):
                if not rows.finished[r] and rows.heal[r] is None and guide.is_done(s):
                    rows.finished[r] = rows.complete[r] = True
            logprobs = guide.apply_mask(logprobs, [None if f or h else s for f, h, s in
                                                   zip(rows.finished, rows.heal, rows.guide_states)])
        if healing:
            logprobs = apply_heal_masks(logprobs, rows.heal)
        if all(rows.finished):
            break
        if any(rows.finished):
            done = torch.tensor(rows.finished, device=logprobs.device)
            logprobs = logprobs.masked_fill(done[:, None], float("-inf"))
            logprobs[done, pad] = 0.0
        ids, ancestors, rows.scores = sampler(logprobs, rows.scores, group, rng)
        reordered = sampler.reorders(group)
        if reordered:
            rows.reorder(ancestors)
            group = n
        step_lp = logprobs[ancestors, ids]
        id_list, lp_list = ids.tolist(), step_lp.tolist()
        keep = [False] * len(id_list)
        for r, (t, l) in enumerate(zip(id_list, lp_list)):
            if rows.finished[r]:
                continue
            if t in eos or l == -math.inf:
                rows.finished[r] = True
                if l == -math.inf:  # a beam with no allowed continuation: dead
                    rows.weights[r] = -math.inf
                elif rows.guide_states is not None:
                    rows.complete[r] = guide.is_final(rows.guide_states[r])
                continue
            keep[r] = rows.accept(r, t)
        if healing:
            rows.heal = [None] * len(keep)
        runs = _forced(rows, keep, steps, group, sampler.is_beam_search) if ff else None
        width = 1 + max(map(len, runs)) if runs else 1
        rows.ensure(col + width)
        if width == 1 and all(keep):  # the common step: one column, every row real
            rows.ids[:, col], rows.mask[:, col], rows.lp[:, col] = ids, 1, step_lp
            rows.weights += torch.tensor(lp_list)
            rows.width = col + 1
        else:
            rows.write_block(col, id_list, lp_list, keep, runs or [[]] * len(keep), width)
        for r, g in enumerate(rows.generated):
            if g >= steps:  # max_tokens or the context limit reached
                rows.finished[r] = True
        yield Step([d.stable_text()[h:] for d, h in zip(rows.detoks, rows.heal_chars)] if rows.detoks is not None else None,
                   reordered)
        if all(rows.finished):
            if runs:  # the forced tokens' log-probs: every column but the last (which stays uncached)
                out, rows.kv = forward(col, col + width - 1, logits="all")
                rows.add_forced_logprobs(col, width, runs, run_logprobs(out, runs, width))
                fed = col + width - 1
            break
        logits, rows.kv = forward(col, col + width, logits="all" if runs else "last")
        if runs:
            rows.add_forced_logprobs(col, width, runs, run_logprobs(logits, runs, width))
            logits = logits[:, -1]
        col = fed = col + width
    return _finish(state, rows, fed, group, guide, kind, parse, max_tokens, sampler)


def _forced(rows: _Rows, keep: list[bool], steps: int, group: int, beams: bool) -> Optional[list[list[int]]]:
    """The forced run of every row after its sampled token, each already accepted by the row (a
    run stops early where a stop string ends the row); ``None`` when no row has one."""
    live = [k and not f for k, f in zip(keep, rows.finished)]
    runs = forced_runs(rows.guide, rows.guide_states, live, [steps - g for g in rows.generated], group, beams)
    for r, run in enumerate(runs):
        for i, t in enumerate(run):
            if not rows.accept(r, t):
                del run[i:]
                break
            if rows.finished[r]:
                del run[i + 1:]
                break
    return runs if any(runs) else None


def _finish(state: SequenceState, rows: _Rows, fed: int, samples: int, guide, kind, parse, max_tokens, sampler) -> SequenceState:
    """Assemble the result state: normalise the layout, order beams, apply stop strings, record the step."""
    R = rows.ids.shape[0]
    raw = SequenceState(model=state._model, ids=rows.ids[:, :rows.width], mask=rows.mask[:, :rows.width],
                        logprobs=rows.lp[:, :rows.width], weights=rows.weights, kv=kvcache.shrink(kvcache.crop(rows.kv, fed)),
                        batch=state.batch, samples=samples)
    real, cached = raw._real_rows(), raw._cached_real()
    tails = [(ids[c:], lps[c:]) for (ids, lps), c in zip(real, cached)]
    out = raw._rebuild(cached, tails, rows.weights, None)
    order = list(range(R))
    if sampler.is_beam_search:  # best first, by the score the search ranked with
        scores = rows.scores.tolist()
        order = [b * samples + i for b in range(state.batch)
                 for i in sorted(range(samples), key=lambda i: -scores[b * samples + i])]
        if order != list(range(R)):
            out = out._select(order, state.batch, samples)
    texts = out.texts
    starts = [rows.start_chars[r] for r in order]  # where each row's detokenized text begins
    cuts = [rows.stop_cut[r] for r in order]
    ends = [s + c if c is not None else len(t) for s, c, t in zip(starts, cuts, texts)]
    starts = [s + rows.heal_chars[r] for s, r in zip(starts, order)]  # a healed token's removed text is input
    complete = tuple(rows.complete[r] or (guide is not None and guide.is_final(rows.guide_states[r]))
                     if rows.guide_states is not None else True for r in order)
    resumable = None
    if guide is not None and not any(c is not None for c in cuts):
        resumable = tuple(rows.guide_states[r] for r in order)
    last = LastStep(kind=kind, starts=tuple(starts), ends=tuple(ends), complete=complete, parse=parse,
                    max_tokens=max_tokens, guide_key=guide.key if guide is not None else None, guide_states=resumable)
    if any(c is not None for c in cuts):
        out = out._truncate(ends)
    return SequenceState(model=out._model, ids=out._ids, mask=out._mask, logprobs=out._logprobs, weights=out._weights,
                         kv=out._kv, batch=out.batch, samples=out.samples, last=last)
