"""The decoding loop: one loop for every generator, from any ``SequenceState``.

::

    state ──▶ prefill the uncached suffix (ONE forward) ──▶ logits
                 ▲                                            │ log-softmax, guide mask
                 │                                            ▼
           forward the new column ◀── append, advance guides ◀── sampler: ids, ancestors, scores
                                      check EOS / stop strings     reorder ALL per-row state (_Rows.reorder)

The loop is a Python generator: it yields a :class:`Step` after every token (streaming reads
them) and returns the final ``SequenceState``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Generator, Optional

import torch

from . import cache as kvcache
from .cfg import CFG, UnconditionalBranch
from .errors import ContextLengthError, GeneratorArgumentError, SampleMismatch
from .guides import DEAD, Guide
from .samplers import Sampler
from .state import LastStep, SequenceState
from .text import Detokenizer, token_char_spans

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
    if not isinstance(stop_at, (str, list, tuple)):
        raise GeneratorArgumentError(f"stop_at must be a string or a list of strings (e.g. '.' or ['.', '\\n']), "
                                     f"got {type(stop_at).__name__}")
    stops = [stop_at] if isinstance(stop_at, str) else list(stop_at)
    if not all(isinstance(s, str) and s for s in stops):
        raise GeneratorArgumentError(f"stop_at must be a non-empty string or a list of them (e.g. '.' or ['.', '\\n']), "
                                     f"got {stop_at!r}: an empty stop string would stop before the first token")
    return stops


class _Rows:
    """All per-row decoding state. :meth:`reorder` is the ONE place rows follow their ancestors."""

    branch: Optional[UnconditionalBranch] = None  # CFG's unconditional branch: its rows follow too

    def __init__(self, state: SequenceState, capacity: int, guide: Optional[Guide], track_text: bool):
        R, L = state._ids.shape
        dev = state._ids.device
        self.ids = torch.full((R, L + capacity), state._model.tokenizer.pad_token_id, dtype=torch.long, device=dev)
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
        self.reason: list[Optional[str]] = [None] * R  # why each row finished (LastStep.finish)
        ctx = state._model.context_length  # tokens each row may still add before its own context limit
        self.room = (ctx - state._mask.sum(1)).tolist() if ctx is not None else [math.inf] * R
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
        real = state._real_rows() if track_text else None
        self.detoks = [Detokenizer(state._model.tokenizer, real[r][0]) for r in range(R)] if track_text else None

    def end(self, r: int, guide: Optional[Guide], reason: str) -> None:
        """Finish row ``r`` for ``reason``; a row cut just as its constraint completed counts as "pattern"."""
        gs = self.guide_states[r] if self.guide_states is not None else None
        self.finished[r], self.reason[r] = True, "pattern" if gs is not None and guide.is_done(gs) else reason

    def reorder(self, ancestors: torch.Tensor) -> None:
        idx = ancestors.tolist()
        a = ancestors.to(self.ids.device)
        self.ids, self.mask, self.lp = self.ids.index_select(0, a), self.mask.index_select(0, a), self.lp.index_select(0, a)
        self.kv = kvcache.select_rows(self.kv, ancestors) if self.branch is None else self.branch.reorder(ancestors, self.kv)
        self.weights = self.weights.index_select(0, ancestors.cpu())
        for name in ("finished", "complete", "stop_cut", "reason", "room", "start_chars"):
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
    ctx = state._model.context_length
    if ctx is None:
        return max_tokens if max_tokens is not None else 2**31
    if int(lengths.max()) > ctx:
        raise ContextLengthError(_too_long(state, ctx))
    room = ctx - int(lengths.min())  # the loop stops every row at its own limit
    return room if max_tokens is None else min(max_tokens, room)


def _too_long(state: SequenceState, ctx: int) -> str:
    """The message for an input longer than the context, with a cut that leaves half of it to generate."""
    keep, tok = ctx // 2, state._model.tokenizer
    long = [(ids, t) for (ids, _), t in zip(state._real_rows(), state.texts) if len(ids) > keep]
    chars = max(1, min(len(t) - token_char_spans(tok, ids)[-keep][0] for ids, t in long))
    worst = max(len(ids) for ids, _ in long)
    return (f"the input has {worst} tokens but the model's context is {ctx}: keep only its end, e.g. "
            f"state[..., -{chars}:] (or prompt[-{chars}:]) keeps about {keep} tokens of every row")


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
    cfg: Optional[CFG] = None,
) -> Generator[Step, None, SequenceState]:
    """Continue ``state`` with ``sampler`` (and ``guide``, and classifier-free guidance ``cfg``); yields a
    :class:`Step` per token, returns the new state."""
    check_max_tokens(max_tokens)
    stops = _stop_list(stop_at)
    steps = check_continuable(state, sampler, max_tokens)
    exhausted = "length" if max_tokens is not None and steps == max_tokens else "context"  # why the last step ends
    model, tok = state._model, state._model.tokenizer
    group, n = state.samples, sampler.samples

    if steps == 0:  # prefill only: everything but the last token, which stays uncached
        state = prefill(state)
    rows = _Rows(state, steps, guide, track_text or bool(stops))
    if cfg is not None and steps > 0:  # a fresh unconditional branch per call: negative prompt + this call's tokens
        rows.branch = UnconditionalBranch(cfg, state, steps)
        steps = rows.branch.steps  # capped where the unconditional rows reach the context
    C, W = kvcache.length(rows.kv), rows.width
    eos, pad = tok.eos_token_ids, tok.pad_token_id

    def forward(start: int, end: int, logits: str = "last"):
        mask = rows.mask[:, :end]
        if end - start == 1:  # one column: positions(mask)[:, -1:] without the cumsum (a pad column of a row
            pos = (mask.sum(1, keepdim=True) - 1).clamp(min=0)  # finished at its context limit stays in range)
        else:
            pos = positions(mask)[:, start:]
        reserve = min(W + steps - end, _RESERVE_CAP)  # the columns still to come: KV storage allocated once
        call = model.forward if rows.branch is None else rows.branch.forward  # CFG: runs both branches
        return call(rows.ids[:, start:end], mask, pos, rows.kv, logits=logits, reserve=reserve)

    if steps == 0:
        if n != group:  # fork: the samples share the prefilled cache
            fork = torch.arange(state.rows).repeat_interleave(n)
            rows.reorder(fork)
            rows.scores = rows.scores.index_select(0, fork.to(rows.scores.device))
        return _finish(state, rows, C, n, guide, kind, parse, max_tokens, sampler, exhausted)

    logits, rows.kv = forward(C, W)
    fed = W
    for step in range(steps):
        logprobs = raw = torch.log_softmax(logits, dim=-1)
        if rows.branch is not None:  # CFG before sampling and masks; the weights stay the raw log-probs
            logprobs = rows.branch.guide(raw)
        if guide is not None:
            for r, s in enumerate(rows.guide_states):
                if not rows.finished[r] and guide.is_done(s):
                    rows.finished[r] = rows.complete[r] = True
                    rows.reason[r] = "pattern"
            logprobs = guide.apply_mask(logprobs, [None if f else s for f, s in zip(rows.finished, rows.guide_states)])
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
        if rows.branch is not None:  # -inf still marks a dead beam
            step_lp = torch.where(step_lp == -math.inf, step_lp, raw[ancestors, ids])
        col = W + step
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
                rows.reason[r] = "pattern" if guide is not None and rows.complete[r] else "eos"
                continue
            if rows.guide_states is not None:
                rows.guide_states[r] = guide.advance(rows.guide_states[r], t)
                if rows.guide_states[r] is DEAD:  # the engine refused a token its mask allowed: end the row, incomplete
                    rows.finished[r], rows.complete[r] = True, False
                    continue
                rows.complete[r] = guide.is_final(rows.guide_states[r])
            keep[r] = True
            if rows.detoks is not None:
                before = len(rows.detoks[r].text)
                text = rows.detoks[r].push(t)
                for s in stops:
                    at = text.find(s, max(0, before - len(s) + 1))
                    if at >= 0 and (rows.stop_cut[r] is None or at + len(s) < rows.stop_cut[r]):
                        rows.stop_cut[r] = at + len(s)
                if rows.stop_cut[r] is not None:
                    rows.finished[r], rows.reason[r] = True, "stop"
            rows.room[r] -= 1
            if rows.room[r] <= 0 and not rows.finished[r]:  # this row's context is full: it ends here
                rows.end(r, guide, exhausted if step == steps - 1 else "context")
        if all(keep):
            rows.ids[:, col], rows.mask[:, col], rows.lp[:, col] = ids, 1, step_lp
            rows.weights += torch.tensor(lp_list)
        else:
            keep_t = torch.tensor(keep, device=rows.ids.device)
            rows.ids[:, col] = torch.where(keep_t, ids.to(rows.ids.device), pad)
            rows.mask[:, col] = keep_t.to(rows.mask.dtype)
            rows.lp[:, col] = torch.where(keep_t, step_lp.to(torch.float32), float("nan"))
            rows.weights += torch.tensor([l if k else 0.0 for l, k in zip(lp_list, keep)])
        rows.width = col + 1
        yield Step([d.stable_text() for d in rows.detoks] if rows.detoks is not None else None, reordered)
        if all(rows.finished) or step == steps - 1:
            break
        logits, rows.kv = forward(col, col + 1)
        fed = col + 1
    if rows.branch is not None:
        rows.kv = rows.branch.release(rows.kv)
    return _finish(state, rows, fed, group, guide, kind, parse, max_tokens, sampler, exhausted)


def _finish(state: SequenceState, rows: _Rows, fed: int, samples: int, guide, kind, parse, max_tokens, sampler,
            exhausted: str) -> SequenceState:
    """Assemble the result state: normalise the layout, order beams, apply stop strings, record the step."""
    R = rows.ids.shape[0]
    for r in range(R):  # rows still running when the steps ran out
        if rows.reason[r] is None:
            rows.end(r, guide, exhausted)
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
    starts = [rows.start_chars[r] for r in order]
    cuts = [rows.stop_cut[r] for r in order]
    ends = [s + c if c is not None else len(t) for s, c, t in zip(starts, cuts, texts)]
    complete = tuple(rows.complete[r] or (guide is not None and guide.is_final(rows.guide_states[r]))
                     if rows.guide_states is not None else True for r in order)
    resumable = None
    if guide is not None and not any(c is not None for c in cuts):
        resumable = tuple(rows.guide_states[r] for r in order)
    last = LastStep(kind=kind, starts=tuple(starts), ends=tuple(ends), complete=complete, parse=parse,
                    max_tokens=max_tokens, guide_key=guide.key if guide is not None else None, guide_states=resumable,
                    finish=tuple(rows.reason[r] for r in order))
    if any(c is not None for c in cuts):
        out = out._truncate(ends)
    return SequenceState(model=out._model, ids=out._ids, mask=out._mask, logprobs=out._logprobs, weights=out._weights,
                         kv=out._kv, batch=out.batch, samples=out.samples, last=last)
