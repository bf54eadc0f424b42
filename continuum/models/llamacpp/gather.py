"""Between the engine's requests and one ``llama_decode``: each request's rows as :class:`~.decode.DecodeRow` s, and
each request's result gathered from the decode's output.

The hot path is a decoding step (``normalize``, one column per row): with Gemma's 262,144-token vocabulary a row of
logits is 1 MiB, so nothing here walks or copies rows one at a time. The step's normalized requests take their
rows of the decode's logits together (a view when they are consecutive, as in a step where every row decodes one
token, else one indexed copy), get ONE log-softmax (torch spreads it over the threads) and each row's best token by
``samplers.row_max`` (numpy's argmax over a vocabulary this wide, several times faster than ``torch.max``); each request reads its
slice of them. Other requests get tensors of their own (their loops may write to them), zeros where a row has no
logits.

Example:
    >>> plans = [plan_rows(r, pool, rows) for r in requests]          # doctest: +SKIP
    >>> out = decode(pool, rows)                                       # doctest: +SKIP
    >>> fill_results(requests, plans, out, vocab)                      # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...samplers import row_max
from ..request import Request
from .decode import DecodeResult, DecodeRow
from .sequences import SequencePool

__all__ = ["RowPlan", "plan_rows", "fill_results"]


@dataclass(slots=True)
class RowPlan:
    """Where a request's rows went: its first :class:`DecodeRow`, its cached columns ``C``, its new columns ``N``,
    and each row's real new columns (None: every new column of every row is real)."""

    first: int
    C: int
    N: int
    reals: list[list[int]] | None


def plan_rows(r: Request, pool: SequencePool, rows: list[DecodeRow]) -> RowPlan:
    """Append ``r``'s rows (its real new tokens after each row's view) to ``rows``; return where they went."""
    first, kv = len(rows), r.kv
    want: Any
    if r.column is not None and kv is not None:  # a decoding step: one new token per row, every row real
        want = "none" if r.logits == "none" else "last"
        rows.extend(DecodeRow(v, (t,), want) for v, t in zip(kv.views, r.column[0]))
        return RowPlan(first, kv.length(), 1, None)
    r.materialize()
    ids, mask = r.ids, r.mask
    R, N = ids.shape
    C = mask.shape[1] - N
    views = kv.views if kv is not None else [pool.empty()] * R
    new_real = mask[:, C:].bool()
    if N and bool(new_real.all()):
        want = r.logits if r.logits in ("all", "none") else "last"
        rows.extend(DecodeRow(v, t, want) for v, t in zip(views, ids.tolist()))
        return RowPlan(first, C, N, None)
    reals = []
    for i in range(R):
        real = new_real[i].nonzero().flatten().tolist()
        if r.logits == "all":
            want = "all"
        elif r.logits == "none" or not real or real[-1] != N - 1:
            want = "none"
        else:
            want = "last"
        reals.append(real)
        rows.append(DecodeRow(views[i], ids[i, real].tolist(), want))
    return RowPlan(first, C, N, reals)


def _last_rows(r: Request, p: RowPlan, offsets: list[int]) -> list[int]:
    """Each row's output index for its last column's logits, -1 where it has none."""
    if p.reals is None:
        return offsets[p.first:p.first + r.rows]
    return [offsets[p.first + i] if real and real[-1] == p.N - 1 else -1 for i, real in enumerate(p.reals)]


def _take(logits: torch.Tensor, idx: list[int], own: bool) -> torch.Tensor:
    """Rows ``idx`` of ``logits`` (zeros for -1): a view when consecutive and not ``own``, else a new tensor."""
    if idx and idx[0] >= 0 and idx == list(range(idx[0], idx[0] + len(idx))):
        view = logits[idx[0]:idx[0] + len(idx)]
        return view.clone() if own else view
    if min(idx, default=0) >= 0:
        return logits.index_select(0, torch.tensor(idx))
    out = torch.zeros((len(idx), logits.shape[1]))
    have = [k for k, j in enumerate(idx) if j >= 0]
    if have:
        out[have] = logits.index_select(0, torch.tensor([idx[k] for k in have]))
    return out


def fill_results(requests: list[Request], plans: list[RowPlan], out: DecodeResult, views_cls: Any, vocab: int) -> None:
    """Set each request's ``result`` (logits or None, and its new KV: ``views_cls(views, cols)``), and a decoding
    step's ``logprobs``/``top`` (see the module docstring)."""
    logits_all = torch.from_numpy(out.logits)
    group: list[tuple[Request, int]] = []  # normalized requests: (request, first row in the group)
    group_idx: list[int] = []
    for r, p in zip(requests, plans):
        R = r.rows
        new_cols = torch.ones((R, 1), dtype=torch.bool) if r.column is not None else r.mask[:, p.C:].bool().cpu()
        old_cols = r.kv.cols if r.kv is not None else torch.zeros((R, p.C), dtype=torch.bool)
        new_kv = views_cls(list(out.views[p.first:p.first + R]), torch.cat([old_cols, new_cols], dim=1))
        lg: torch.Tensor | None = None
        if r.logits == "all":
            lg = torch.zeros((R, p.N, vocab))
            for i in range(R):
                a, b = out.offsets[p.first + i], out.offsets[p.first + i + 1]
                if b > a:
                    lg[i, p.reals[i] if p.reals is not None else slice(None)] = logits_all[a:b]
        elif r.logits != "none":
            idx = _last_rows(r, p, out.offsets)
            if r.normalize:
                group.append((r, len(group_idx)))
                group_idx.extend(idx)
            else:
                lg = _take(logits_all, idx, own=True)
        r.result, r.error = (lg, new_kv), None
    if group:
        # in place: the decode's logits are this step's own copy (a fresh 32 MiB output costs more in page faults
        # than the log-softmax itself), and the other requests took theirs above
        x = _take(logits_all, group_idx, own=False)
        lp = torch.log_softmax(x, dim=-1, out=x)
        best_t, top_t = row_max(lp)
        best, top_list = best_t.tolist(), top_t.tolist()
        for r, row in group:
            r.logprobs, r.top = (lp, row), (top_list[row:row + r.rows], best[row:row + r.rows])
