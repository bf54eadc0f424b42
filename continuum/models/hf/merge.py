"""One model forward for the requests of several concurrent calls: the KV layout of merged batches.

A *request* is what one call's decoding loop passes to ``model.forward``: new columns ``ids``
``(rows, new)``, a 2-D ``mask`` over its cached + new columns, positions, its cache (or None) and
which logits it wants. Requests are merged into *slabs*: one preallocated key/value tensor per
layer, ``(row capacity, heads, column capacity, head_dim)``, in which each call owns a contiguous
range of rows and every call's columns END at the same column (``slab.end``)::

    row 0-1  (call A, 7 cached) . . . a a a a a a a | n      . = masked hole (zeros)
    row 2    (call B, 4 cached) . . . . . . b b b b | n      | = slab.end: the next columns go here
    row 3    (call C, left)     . . c c c c c c c c | x      x = a departed call's dead row (masked)
    rows 4-7 spare (never handed out: a newcomer's cache is copied here once when it joins)

A call gets back row-slices of the slab (views: no copy), covering exactly its own columns. At
the next step its cache is recognised as "in place" (a view of a slab that ends where the view
ends) and the new columns are written at ``slab.end`` for every row: a stable cohort costs no copy
per step. Copy-on-write, as in :mod:`continuum.models.hf.cache`: ``end`` only grows, every view ends at or
before it, and only never-used rows are filled with a newcomer's cache, so no state ever sees a
value change. A newcomer (a cache that is not in place: a fork, a beam reorder, a state from
elsewhere) is copied into spare rows, left-padded to ``end`` (its own KV, once). When that is not
possible (no spare rows, a newcomer longer than ``end``, no spare columns, too many dead rows, a slab
far wider than its calls since a long one left) the group is laid out in a new slab (one copy of everyone's KV).

Requests are grouped by the number of new columns (a one-column decoding step is never padded to
a 500-column prefill): fresh prefills (no cache) merge across lengths, right-aligned (the last
column of every row is real); cached requests merge with those of the same width. Each group is
one forward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from ..request import Request, compact_outputs, normalized
from . import cache as kvcache
from .slab import Slab, SlabView, slot_of
from .tensorkv import layers_of

__all__ = ["Slab", "plan", "run_group", "slot_of", "groups"]

_SPARE_ROWS = 0.5  # a new slab keeps this fraction of its rows (at least 4) free for joiners
_MAX_DEAD = 0.25  # dead rows allowed in a reused slab, as a fraction of the live rows
_WIDE_SLACK = 64  # masked columns a reused slab may have in front of its longest call (or as many as it has cached)
_PREFILL_PAD = 1.5  # fresh prefills of different lengths share a forward while padded cells <= this x real ones


@dataclass
class Plan:
    """How one group of requests is laid out: the slab, each request's first row, the cached width."""

    slab: Slab
    requests: list[Request]
    first_rows: list[int]
    cached: int  # C: columns before the new ones (slab.end before this step)
    new: int  # N
    forward_rows: int  # rows [0, forward_rows) of the slab run (dead rows included)
    copies: list[tuple[kvcache.KV | None, int, int]] = field(default_factory=list)  # (newcomer's cache, first row, rows)
    fresh: bool = False  # a new slab (every row copied in, zero-filled where masked)
    zeroed: list[tuple[int, int]] = field(default_factory=list)  # newcomers' row spans, zeroed before C (run_group)
    runs: list[tuple[Any, int, int, Any]] = field(default_factory=list)  # the copies as runs (_copy_runs; run_group)
    joiners: list[Request] = field(default_factory=list)  # requests whose cached mask the slab does not hold yet
    rows_index: Any = None  # the slab row of every request row, in request order (set by merged_inputs)
    allowed: Any = None  # token trees: the merged explicit attention (set by merged_inputs)


def _in_place(r: Request) -> tuple[Slab, int, int, int] | None:
    """The slot of ``r``'s cache when it is exactly a view a merged forward handed out, ending at its slab's end."""
    kv = layers_of(r.kv)
    if isinstance(kv, SlabView):  # handed out as it is: its slot is its layout
        slab, row, rows, start = kv.slot
        return kv.slot if rows == r.rows and slab.end == start + kv.width else None
    slot = slot_of(kv)
    if slot is None or kv is None:
        return None
    slab, row, rows, start = slot
    C = r.cached
    if rows != r.rows or slab.end != start + C or len(kv) != len(slab.keys):
        return None
    for (k, v), K, V in zip(kv, slab.keys, slab.values):  # every layer, not only the marked one
        if K is None or V is None or k.shape != (rows, K.shape[1], C, K.shape[3]) or k.data_ptr() != K[row, :, start].data_ptr() \
                or v.data_ptr() != V[row, :, start].data_ptr() or k.stride() != K.stride():
            return None
    return slot


def plan(requests: list[Request], layers: int) -> Plan:
    """Lay out one group (same new width, or all fresh): reuse the slab most of them are in, or a new one."""
    N = max(r.new for r in requests)
    slots = [_in_place(r) for r in requests]
    best: dict[int, tuple[Slab, int]] = {}
    for r, slot in zip(requests, slots):
        if slot is not None:
            s, rows = best.get(id(slot[0]), (slot[0], 0))
            best[id(slot[0])] = (s, rows + r.rows)
    slab = max(best.values(), key=lambda x: x[1])[0] if best else None
    if slab is not None:
        taken = bytearray(slab.rows_cap)  # rows already claimed (two requests may hold views of the same rows)
        first: dict[int, int] = {}
        members, newcomers = [], []
        top = 0
        for r, slot in zip(requests, slots):
            if slot is not None and slot[0] is slab and not any(taken[slot[1]:slot[1] + r.rows]):
                taken[slot[1]:slot[1] + r.rows] = b"\1" * r.rows
                members.append(r)
                first[id(r)] = slot[1]
                top = max(top, slot[1] + r.rows)
            else:
                newcomers.append(r)
        live = sum(r.rows for r in requests)
        joining = sum(r.rows for r in newcomers)
        # rows of departed calls after the last member's are left out of the forward when nobody joins
        top = slab.rows_used if newcomers else top
        dead = top - sum(r.rows for r in members)
        need = max(r.cached for r in requests)  # a slab far wider than its calls (a long call left) is laid out again:
        # every row pays the slab's width, which the scheduler's count (Scheduler.slab_bytes) prices at the live calls'
        if (all(r.cached <= slab.end for r in newcomers) and slab.rows_used + joining <= slab.rows_cap
                and slab.end + N <= slab.cols_cap and dead <= _MAX_DEAD * live and min(r.new for r in requests) == N
                and slab.end - need <= max(_WIDE_SLACK, need)):
            copies = []
            row = slab.rows_used
            for r in newcomers:
                first[id(r)] = row
                copies.append((layers_of(r.kv), row, r.rows))
                row += r.rows
            return Plan(slab, requests, [first[id(r)] for r in requests], slab.end, N, row if newcomers else top, copies,
                        joiners=newcomers)
    # a new slab: rows in request order, columns right-aligned at the longest cache
    C = max(r.cached for r in requests)
    rows = sum(r.rows for r in requests)
    reserve = min(max(r.reserve for r in requests), kvcache.RESERVE_CAP)
    new = Slab(layers, rows + max(4, int(rows * _SPARE_ROWS)), C + N + max(reserve, 64))
    starts: list[int] = []
    fill: list[tuple[kvcache.KV | None, int, int]] = []
    row = 0
    for r in requests:
        starts.append(row)
        fill.append((layers_of(r.kv), row, r.rows))
        row += r.rows
    return Plan(new, requests, starts, C, N, row, fill, fresh=True, joiners=list(requests))


def groups(requests: list[Request]) -> list[list[Request]]:
    """Requests that share a forward: fresh prefills by similar length, cached ones by equal new width."""
    out: list[list[Request]] = []
    fresh = sorted((r for r in requests if r.kv is None and r.logits != "all" and r.allowed is None), key=lambda r: -r.new)
    group: list[Request] = []
    real = 0
    for r in fresh:
        n = group[0].new if group else r.new
        if group and (sum(g.rows for g in group) + r.rows) * n > _PREFILL_PAD * (real + r.rows * r.new):
            out.append(group)
            group, real = [], 0
        group.append(r)
        real += r.rows * r.new
    if group:
        out.append(group)
    by_width: dict[tuple[int, bool], list[Request]] = {}  # token trees merge with token trees
    for r in requests:
        if r.kv is not None or r.logits == "all" or r.allowed is not None:
            by_width.setdefault((r.new, r.allowed is not None), []).append(r)
    return out + list(by_width.values())


@functools.cache
def _slab_layer() -> type:
    """A ``DynamicLayer`` that reads its cache from, and writes its new columns into, a :class:`Slab`."""
    from transformers.cache_utils import DynamicLayer

    class SlabLayer(DynamicLayer):
        def __init__(self, plan: Plan, index: int):
            super().__init__()
            self.plan, self.index = plan, index
            self.is_initialized = True

        def get_seq_length(self) -> int:
            return self.plan.cached

        def update(self, key_states, value_states, *args, **kwargs):
            p, i = self.plan, self.index
            slab, C, N, R = p.slab, p.cached, p.new, p.forward_rows
            self.dtype, self.device = key_states.dtype, key_states.device
            if slab.keys[i] is None:
                shape = (slab.rows_cap, key_states.shape[1], slab.cols_cap, key_states.shape[3])
                slab.keys[i], slab.values[i] = key_states.new_empty(shape), value_states.new_empty(shape)
            K, V = slab.keys[i], slab.values[i]
            for a, b in p.zeroed:  # newcomers: their cache right-aligned at C, zeros before (masked, never NaN)
                K[a:b, :, :C] = 0
                V[a:b, :, :C] = 0
            for kv, row, rows, src in p.runs:
                if src is not None:  # consecutive rows of one slab: one copy for the run
                    (S, srow, srows, start), n = src
                    K[row:row + rows, :, C - n:C] = S.keys[i][srow:srow + srows, :, start:start + n].to(K.device)
                    V[row:row + rows, :, C - n:C] = S.values[i][srow:srow + srows, :, start:start + n].to(V.device)
                elif kv is not None and (n := kv[i][0].shape[2]):
                    K[row:row + rows, :, C - n:C] = kv[i][0].to(K.device)
                    V[row:row + rows, :, C - n:C] = kv[i][1].to(V.device)
            K[:R, :, C:C + N] = key_states
            V[:R, :, C:C + N] = value_states
            self.keys, self.values = K[:R, :, :C + N], V[:R, :, :C + N]
            return self.keys, self.values

    return SlabLayer


def _zero_spans(copies: list[tuple[kvcache.KV | None, int, int]]) -> list[tuple[int, int]]:
    """The newcomers' rows to zero before their copies: one span when they follow each other (plan() gives them
    one range of rows), else one per newcomer."""
    spans = [(row, row + rows) for _, row, rows in copies]
    if spans and all(b == a2 for (_, b), (a2, _) in zip(spans, spans[1:])):
        return [(spans[0][0], spans[-1][1])]
    return spans


def _copy_runs(copies: list[tuple[kvcache.KV | None, int, int]]) -> list[tuple[Any, int, int, Any]]:
    """Newcomers' copies ``(cache, first row, rows)`` with consecutive views of one slab (same columns, rows
    following each other there and here: a cohort re-laid out, or joining together) merged into runs
    ``(None, first row, rows, ((slab, first row there, rows, first column), width))``; the others as they are,
    with ``None``."""
    out: list[tuple[Any, int, int, Any]] = []
    for kv, row, rows in copies:
        if isinstance(kv, SlabView):
            slab, srow, srows, start = kv.slot
            if out and out[-1][3] is not None:
                (S, prow, prows, pstart), width = out[-1][3]
                if S is slab and pstart == start and width == kv.width and prow + prows == srow \
                        and out[-1][1] + out[-1][2] == row:
                    out[-1] = (None, out[-1][1], out[-1][2] + rows, ((S, prow, prows + srows, start), width))
                    continue
            out.append((None, row, rows, ((slab, srow, srows, start), kv.width)))
        else:
            out.append((kv, row, rows, None))
    return out


def merged_inputs(p: Plan, device: torch.device, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids ``(R, N)``, mask ``(R, C + N)`` and positions ``(R, N)`` of the merged forward.

    A request's cached columns end at C (masked holes before); its new columns end at C + N
    (fresh prefills shorter than N: masked holes before them). Dead rows attend only to their
    own new column (never an all-masked row, whose softmax would be NaN). The mask is the slab's
    own (kept between steps): only joiners' cached columns and every row's new columns are written,
    the new columns of a stable cohort in one indexed copy.
    """
    R, C, N = p.forward_rows, p.cached, p.new
    slab = p.slab
    if slab.mask is None:
        slab.mask = torch.zeros((slab.rows_cap, slab.cols_cap), dtype=torch.long, device=device)
    mask = slab.mask
    joining = {id(r) for r in p.joiners} | {id(r) for r in p.requests if r.remask}  # (remask: holes since the
    for r in p.requests:  # last step, e.g. speculation's rejected drafts, whose cells the slab's mask still shows)
        if id(r) in joining:
            r.materialize()
    for r, row in zip(p.requests, p.first_rows):  # joiners' cached columns, right-aligned at C
        if id(r) in joining:
            c = r.cached
            mask[row:row + r.rows, :C - c] = 0
            mask[row:row + r.rows, C - c:C] = r.mask[:, :c]
    index: list[int] = []
    for r, row in zip(p.requests, p.first_rows):
        index.extend(range(row, row + r.rows))
    rows = torch.tensor(index, device=device)
    mask[:R, C:C + N] = 0
    ids = torch.full((R, N), pad_id, dtype=torch.long, device=device)
    pos = torch.zeros((R, N), dtype=torch.long, device=device)
    if all(r.column is not None and r.ids is None for r in p.requests):  # a stable cohort of decode steps: lists
        flat_ids: list[int] = []
        flat_pos: list[int] = []
        for r in p.requests:
            flat_ids += r.column[0]  # type: ignore[index]
            flat_pos += r.column[1]  # type: ignore[index]
        ids[rows, 0] = torch.tensor(flat_ids, device=device)
        pos[rows, 0] = torch.tensor(flat_pos, device=device)
        mask[rows, C] = 1
    elif all(r.new == N for r in p.requests):
        for r in p.requests:
            r.materialize()
        ids[rows] = torch.cat([r.ids for r in p.requests])
        pos[rows] = torch.cat([r.pos for r in p.requests])
        mask[rows, C:C + N] = torch.cat([r.mask[:, r.cached:] for r in p.requests]).to(mask.dtype)
    else:  # fresh prefills of several lengths, right-aligned
        for r, row in zip(p.requests, p.first_rows):
            r.materialize()
            n, c = r.new, r.cached
            ids[row:row + r.rows, N - n:] = r.ids
            mask[row:row + r.rows, C + N - n:C + N] = r.mask[:, c:]
            pos[row:row + r.rows, N - n:] = r.pos
    dead = None
    if len(index) < R:  # dead rows: their own new column only
        live = torch.zeros(R, dtype=torch.bool, device=device)
        live[rows] = True
        dead = (~live).nonzero().flatten()
        mask[dead, C + N - 1] = 1
    p.rows_index = rows
    if any(r.allowed is not None for r in p.requests):  # token trees: each row's explicit attention, laid out likewise
        allowed = torch.zeros((R, N, C + N), dtype=torch.bool, device=device)
        for r, row in zip(p.requests, p.first_rows):
            c = r.cached
            if r.allowed is not None:  # (groups hold token trees only, or none)
                allowed[row:row + r.rows, :, C - c:C] = r.allowed[:, :, :c]
                allowed[row:row + r.rows, :, C:] = r.allowed[:, :, c:]
        if dead is not None:
            allowed[dead, torch.arange(N, device=device)[:, None], C + torch.arange(N, device=device)[:, None]] = True
        p.allowed = allowed
    return ids, mask[:R, :C + N].contiguous(), pos


def split_outputs(p: Plan, logits: torch.Tensor | None,
                  compact: list[torch.Tensor] | None = None) -> list[tuple[torch.Tensor | None, kvcache.KV]]:
    """Each request's logits and its row-slice of the slab (lazy views covering exactly its own columns); a
    ``logits="outputs"`` request's as ``(read, vocab)`` rows (``compact``: already split per request)."""
    C, N = p.cached, p.new
    out = []
    for k, (r, row) in enumerate(zip(p.requests, p.first_rows)):
        width = r.cached + r.new
        start = C + N - width  # contiguous: a cached request has N new columns, a fresh one no cached ones
        view: Any = SlabView((p.slab, row, r.rows, start), width)
        if compact is not None:
            lg = compact[k]
        elif logits is None or r.logits == "none" or (r.normalize and r.logits == "last"):
            lg = None  # (a normalized request reads its log-probs, log_probs(), only if it needs the tensor)
        elif r.logits == "last":
            lg = logits[row:row + r.rows, -1]
        elif r.logits == "outputs":
            lg = compact_outputs(logits[row:row + r.rows, N - r.new:], r.outputs)
        else:
            lg = logits[row:row + r.rows, N - r.new:]
        out.append((lg, view))
    if logits is not None and any(r.normalize and r.logits == "last" for r in p.requests):
        lp, best, top = normalized(logits[:, -1])  # once for the whole group
        for r, row in zip(p.requests, p.first_rows):
            if r.normalize and r.logits == "last":
                r.logprobs = (lp, row)
                r.top = (top[row:row + r.rows], best[row:row + r.rows])
    return out


def run_group(model, p: Plan) -> list[tuple[torch.Tensor | None, kvcache.KV]]:
    """Run one planned group as ONE forward of ``model`` (a ``Transformers`` adapter)."""
    from transformers import DynamicCache

    layer_cls = _slab_layer()
    cache = DynamicCache()
    cache.layers = [layer_cls(p, i) for i in range(len(p.slab.keys))]
    p.zeroed, p.runs = _zero_spans(p.copies), _copy_runs(p.copies)  # (once: every layer copies the same way)
    ids, mask, pos = merged_inputs(p, model.device, model.tokenizer.pad_token_id)
    want = "all" if any(r.logits in ("all", "outputs") for r in p.requests) else (
        "none" if all(r.logits == "none" for r in p.requests) else "last")
    compact = None
    if p.allowed is not None and all(r.logits == "outputs" for r in p.requests):
        # token trees whose owners read some nodes: only those rows' logits, row-major (no (rows, N, vocab) tensor,
        # which a large vocabulary makes hundreds of MB); each request's rows are one slice of them, in row order
        N = p.new
        read = torch.zeros((ids.shape[0], N), dtype=torch.bool)
        for r, row in zip(p.requests, p.first_rows):
            read[row:row + r.rows, N - r.new:] = True if r.outputs is None else r.outputs.bool().cpu()
        flat = model._run(ids, mask, pos, cache, "outputs", p.allowed, read)
        counts = [int(read[row:row + r.rows].sum()) for r, row in zip(p.requests, p.first_rows)]
        order = sorted(range(len(counts)), key=lambda k: p.first_rows[k])
        parts = dict(zip(order, flat.split([counts[k] for k in order])))
        compact = [parts[k] for k in range(len(counts))]
        logits = None
    else:
        outputs = None  # token trees whose owners name the nodes they read: the union's columns only (model._run)
        named = [r.outputs for r in p.requests if r.outputs is not None]
        if p.allowed is not None and want == "all" and len(named) == len(p.requests):
            outputs = torch.cat([o.bool().any(0, keepdim=True) for o in named])
        logits = model._run(ids, mask, pos, cache, "all" if want == "all" else "last", p.allowed, outputs)  # (rows, 1|N, vocab)
    slab = p.slab
    slab.rows_used = max(slab.rows_used, p.forward_rows)
    slab.end = p.cached + p.new
    p.copies, p.zeroed, p.runs = [], [], []
    return split_outputs(p, None if want == "none" else logits, compact)
