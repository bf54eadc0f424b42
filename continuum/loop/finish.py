"""A call's finish: the result state assembled from its rows (layout normalised, beams best first, stop strings
applied, the step's record: :class:`~continuum.state.LastStep`)."""

from __future__ import annotations

from ..models import kv as kvcache
from ..state import LastStep, SequenceState
from .fastforward import step_marks
from .rows import Rows

__all__ = ["finish"]


def finish(state: SequenceState, rows: Rows, fed: int, samples: int, guide, kind, parse, max_tokens, sampler,
            exhausted: str, speculation: dict | None = None) -> SequenceState:
    """Assemble the result state: normalise the layout, order beams, apply stop strings, record the step."""
    rows.flush()
    R, tok = rows.ids.shape[0], state._model.tokenizer
    for r in range(R):  # rows still running when the steps ran out
        if rows.reason[r] is None:
            rows.end(r, exhausted)
    kv = kvcache.finish(rows.kv, fed)  # (a view of merged storage gets its own copy: a small part must not pin it)
    normal = 0 < fed < rows.width and (bool(rows.mask[0, fed - 1:rows.width].all()) if R == 1 else  # (one read)
                                       bool(rows.mask[:, fed:rows.width].all()) and bool(rows.mask[:, fed - 1].any()))
    # (normal: already the layout _rebuild makes, every row's uncached tail real and the last cached column used; the
    # KV compacted as _rebuild leaves it)
    raw = SequenceState(model=state._model, ids=rows.ids[:, :rows.width], mask=rows.mask[:, :rows.width],
                        logprobs=rows.lp[:, :rows.width], weights=rows.weights,
                        kv=kvcache.compact(kv) if normal else kv, batch=state.batch, samples=samples)
    if normal:
        out = raw
    else:
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
    if guide is not None and rows.guide_states is not None and not any(c is not None for c in cuts):
        resumable = tuple(rows.guide_states[r] for r in order)
    real = out._real_rows()  # forced and healed tokens, for the display (LastStep.marks)
    marks = tuple(step_marks(tok, real[i][0], texts[i], rows.generated[r],
                             {**{o: "forced" for o in rows.forced[r]}, **({0: "healed"} if rows.heal_chars[r] else {})},
                             starts[i]) for i, r in enumerate(order))
    last = LastStep(kind=kind, starts=tuple(starts), ends=tuple(ends), complete=complete, parse=parse,
                    max_tokens=max_tokens, guide_key=guide.key if guide is not None else None, guide_states=resumable,
                    finish=tuple(rows.reason[r] or exhausted for r in order), marks=marks,  # (every row ended above)
                    speculation=dict(speculation) if speculation is not None else None)
    if any(c is not None for c in cuts):
        out = out._truncate(ends)
    done = SequenceState(model=out._model, ids=out._ids, mask=out._mask, logprobs=out._logprobs, weights=out._weights,
                         kv=out._kv, batch=out.batch, samples=out.samples, last=last)
    return done._memo_from(out)  # (the same tensors: its texts and rows, read above, reused by .value and the next call)
