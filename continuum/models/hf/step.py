"""One engine step on the transformers backend: the step's requests as merged forwards, one per group
(:mod:`continuum.models.hf.merge`, laid out in slabs), the rest alone; a failed merged forward re-run per request
(its error to its owner only); the counters it moves (``Engine.stats()``)."""

from __future__ import annotations

import time

from ..request import Request, normalized
from . import merge
from .tensorkv import TensorKV, layers_of

__all__ = ["run_requests"]


def run_requests(model, batch: list[Request], stats: dict) -> None:
    """Run every request of the step: merged forwards by group, the rest alone; errors to their owners."""
    # A hybrid model's rows run alone: merged slabs hold attention KV only, and hybrid.py groups rows by padding.
    recurrent = getattr(model, "hybrid", None) is not None
    alone = [r for r in batch if recurrent or not r.mergeable]
    merged = [] if recurrent else [r for r in batch if r.mergeable]
    for group in merge.groups(merged):
        if len(group) == 1 and merge.slot_of(layers_of(group[0].kv)) is None:
            alone.append(group[0])
            continue
        try:
            p = merge.plan(group, len(layers_of(group[0].kv)) if group[0].kv is not None else model._layers)
            t = time.perf_counter()
            results = merge.run_group(model, p)
            stats["forward_s"] += time.perf_counter() - t
        except Exception:  # noqa: BLE001  (the merged forward failed: run each alone, so an error reaches only its owner)
            stats["fallbacks"] += 1
            alone.extend(group)
            continue
        _note(p, stats)
        for r, (lg, kv) in zip(group, results):  # a one-off request's owner gets plain views (a loop: lazy ones)
            r.result, r.error = (lg, TensorKV(kv if r.event is None else tuple(kv))), None
        stats["peak_kv_bytes"] = max(stats["peak_kv_bytes"], p.slab.nbytes())
        with model._count_lock:
            model.tokens_computed += sum(r.rows * r.new for r in group)
        stats["merged_forwards"] += 1
        stats["requests_merged"] += len(group)
    for r in alone:
        stats["alone"] += 1
        try:
            r.materialize()
            t = time.perf_counter()
            lg, kv = model.forward_now(r.ids, r.mask, r.pos, r.kv, logits=r.logits, reserve=r.reserve,
                                          allowed=r.allowed, outputs=r.outputs)
            stats["forward_s"] += time.perf_counter() - t
            if r.normalize and r.logits == "last":
                lp, best, top = normalized(lg)
                r.logprobs, r.top, lg = (lp, 0), (top, best), None
            r.result, r.error = (lg, kv), None
        except Exception as exc:  # noqa: BLE001  (handed to the request's owner, raised there)
            r.error = exc

def _note(p: merge.Plan, stats: dict) -> None:
    """Statistics of a planned merged forward: rows, padding (cells / real tokens), KV bytes."""
    s = stats
    s["new_slabs"] += p.fresh
    s["joins_copied"] += sum(r.kv is not None for r in p.joiners) if not p.fresh else 0
    cells = p.forward_rows * (p.cached + p.new)
    s["peak_rows"] = max(s["peak_rows"], p.forward_rows)
    if cells >= s["_peak_cells"] and p.slab.mask is not None:
        real = int(p.slab.mask[p.rows_index, :p.cached + p.new].sum())  # the live rows' real tokens
        s["_peak_cells"] = cells
        s["peak_padding"] = cells / max(real, 1)
