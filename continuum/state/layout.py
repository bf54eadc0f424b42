"""Ragged rows laid out as a state's tensors: left-padded (right-aligned) ids, attention mask and log-probs, and a
state rebuilt as kept cached prefixes followed by new right-aligned tails (:func:`rebuild`)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from ..models import kv as kvcache

__all__ = ["right_aligned", "rebuild", "kept_rows", "NAN"]

NAN = float("nan")


def right_aligned(rows: Sequence[Sequence[int]], lps: Sequence[Sequence[float]], pad: int,
                  device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad ragged rows into (ids, mask, logprobs) tensors."""
    width = max((len(r) for r in rows), default=0)
    if width and all(len(r) == width for r in rows):  # (no padding: a lone prompt, a joint call's rows)
        return (torch.tensor(rows, dtype=torch.long, device=device), torch.ones((len(rows), width), dtype=torch.long,
                device=device), torch.tensor(lps, dtype=torch.float32, device=device))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lp = torch.full((len(rows), width), NAN, dtype=torch.float32)
    for i, (r, row_lps) in enumerate(zip(rows, lps)):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
            lp[i, width - len(r):] = torch.tensor(row_lps, dtype=torch.float32)
    return ids.to(device), mask.to(device), lp.to(device)


def kept_rows(real: Sequence[tuple[list[int], list[float]]], keep: Sequence[int],
              tails: Sequence[tuple[list[int], list[float]]]) -> list[tuple[list[int], list[float]]]:
    """The real rows (ids, log-probs) of :func:`rebuild`'s result: each row's first ``keep[r]`` real tokens, then its
    tail, the tail's log-probs rounded as the float32 tensor holds them (a client may send any float)."""
    return [(ids[:k] + t, lps[:k] + array("f", p).tolist()) for (ids, lps), k, (t, p) in zip(real, keep, tails)]


def rebuild(state, keep_cached: Sequence[int], tails: Sequence[tuple[list[int], list[float]]], weights: torch.Tensor,
            last):
    """``state`` keeping, per row, its first ``keep_cached[r]`` cached tokens, followed by ``tails[r]``.

    The kept cached columns stay where they are (a view of the cache; cut tokens become holes);
    the tails form a right-aligned uncached suffix. A row left with an empty tail gets its last
    kept token moved into the suffix, so every row ends on an uncached real token.
    """
    C = kvcache.length(state._kv)
    keep = list(keep_cached)
    tails = [(list(t), list(p)) for t, p in tails]
    real = state._real_rows()
    for r in range(state.rows):
        if not tails[r][0] and keep[r] > 0:
            keep[r] -= 1
            tails[r] = ([real[r][0][keep[r]]], [real[r][1][keep[r]]])
    device = state._ids.device
    if C and keep == state._cached_real() and state._last_column_used(C):
        C2, kept = C, None  # every cached token kept (text appended: the common case): the columns as they are
    elif C:
        region = state._mask[:, :C]
        rank = region.cumsum(1)
        kept = region.bool() & (rank <= torch.tensor(keep, device=device)[:, None])
        cols = torch.arange(C, device=device)
        last_col = torch.where(kept, cols, -1).amax(1)
        C2 = int(last_col.max()) + 1
    else:
        C2, kept = 0, None
    tail_ids, tail_mask, tail_lp = right_aligned([t for t, _ in tails], [p for _, p in tails],
                                                  state._model.tokenizer.pad_token_id, device)
    kv = kvcache.crop(state._kv, C2)
    if kept is not None and C2 and not torch.equal(kept[:, :C2], region[:, :C2].bool()):
        # (a backend whose views attend to every cell must drop the cut ones; a hybrid's may have cut further
        kv = kvcache.keep(kv, kept[:, :kvcache.length(kv)])  # back, to a recurrent snapshot: it covers less)
    if C2:
        ids = torch.cat([state._ids[:, :C2], tail_ids], 1)
        mask = torch.cat([state._mask[:, :C2] if kept is None else kept[:, :C2].to(state._mask.dtype), tail_mask], 1)
        lp = torch.cat([state._logprobs[:, :C2], tail_lp], 1)
    else:
        ids, mask, lp = tail_ids, tail_mask, tail_lp
    # (compact only what a cut made smaller: appending keeps what this state viewed, e.g. a joint call's rows)
    out = state._new(model=state._model, ids=ids, mask=mask, logprobs=lp, weights=weights,
                     kv=kvcache.compact(kv) if C2 < C else kv, batch=state.batch, samples=state.samples, last=last)
    # (its real rows are known by construction, not read back from the tensors; and where every cached column
    # stayed, the cache covers what it covered before)
    out._cache["real"] = kept_rows(real, keep, tails)
    if kept is None and C2 == C:
        out._cache["cached"] = keep
    return out
