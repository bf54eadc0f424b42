"""Laying many states' rows into one batch (``SequenceState.stack``), as a few tensor operations for all rows at once.

Each state's cached columns are right-aligned at column ``C`` (the widest cache) and its uncached suffix at ``C + S``
(the widest suffix); columns a row does not fill are padding (``pad_id``, mask 0, NaN log-prob, zero KV). Written row
by row this was a handful of small tensor operations per state and layer: 128 one-row states from a joint call took
~13 ms to stack on stories260K (B22b: run_batch's joint calls stack their callers' states before each call). Here each
of ids, mask and log-probs is one scatter, and each layer's keys and values one gather and one scatter per parent
cache (the states a joint call handed out share one), for every row together: the same tensors, bit for bit.

Example:
    >>> ids, mask, lp = tokens(states, widths, C, S, pad_id)          # doctest: +SKIP
    >>> layers = kv_layers(states, widths, C)                         # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..models import kv as kvcache

__all__ = ["tokens", "kv_layers"]


def _rows(states: Sequence[Any], widths: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Each row's cached columns and suffix columns (a state's widths repeated for each of its rows)."""
    cached, suffix = [], []
    for s, (c, w) in zip(states, widths):
        cached += [c] * s.rows
        suffix += [w] * s.rows
    return cached, suffix


def _offsets(n: torch.Tensor) -> torch.Tensor:
    """For rows of ``n[r]`` entries laid end to end: each entry's index within its row."""
    return torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)


def tokens(states: Sequence[Any], widths: Sequence[tuple[int, int]], C: int, S: int,
           pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, mask, logprobs)`` of the stacked rows, ``(rows, C + S)``: each row's cached columns end at ``C``, its
    suffix at ``C + S``."""
    first = states[0]
    cached, suffix = _rows(states, widths)
    R, W = len(cached), C + S
    c = torch.tensor(cached)
    n = c + torch.tensor(suffix)  # each row's columns
    row = torch.repeat_interleave(torch.arange(R), n)
    j = _offsets(n)  # column within its row
    c_at = c[row]
    # cached columns land at C - c + j, suffix columns at C + S - n + j (right-aligned at C + S)
    col = torch.where(j < c_at, C - c_at + j, W - n[row] + j)
    flat = row * W + col
    out = []
    for name, fill in (("_ids", pad_id), ("_mask", 0), ("_logprobs", float("nan"))):
        like = getattr(first, name)
        t = like.new_full((R, W), fill)
        src = torch.cat([getattr(s, name).reshape(-1) for s in states])
        t.view(-1)[flat.to(t.device)] = src.to(t.dtype)
        out.append(t)
    return out[0], out[1], out[2]


def kv_layers(states: Sequence[Any], widths: Sequence[tuple[int, int]], C: int) -> tuple:
    """The stacked rows' KV tensors, one ``(keys, values)`` pair per layer, ``(rows, heads, C, head_dim)``: each row's
    cached columns right-aligned at ``C``, zeros before them (masked; never uninitialised memory, as 0 x NaN is NaN
    in attention).

    Each state's cache is read where it lies (``kv.row_span``): the states a joint call handed its callers are lazy
    views of one parent cache, so stacking them back is one gather and one scatter per tensor from that parent, not a
    view and a copy per state."""
    cached, _ = _rows(states, widths)
    R = len(cached)
    # per parent cache (by identity): where each of its cached entries comes from and goes to
    sources: dict[int, tuple[Any, list[tuple[int, int, int, int, int]]]] = {}
    row = 0
    for s, (c, _) in zip(states, widths):
        if c and s._kv is not None:
            span = kvcache.row_span(s._kv)
            assert span is not None  # (a backend without tensors stacks its own handles: combine.stack)
            parent, first, lead = span
            sources.setdefault(id(parent), (parent, []))[1].append((row, s.rows, c, first, lead))
        row += s.rows
    ref = next(iter(sources.values()))[0]
    plans: list[tuple[Any, dict, tuple[torch.Tensor, ...]]] = []
    for parent, spans in sources.values():
        at_row, at_n, at_c, at_first, at_lead = (torch.tensor(x) for x in zip(*spans))  # (one entry per state)
        per = torch.repeat_interleave(at_c, at_n)  # each row's cached columns
        within = _offsets(at_n)  # each row's index in its state
        rows_out = torch.repeat_interleave(torch.repeat_interleave(at_row, at_n) + within, per)
        rows_in = torch.repeat_interleave(torch.repeat_interleave(at_first, at_n) + within, per)
        j = _offsets(per)
        cols_out = C - torch.repeat_interleave(per, per) + j
        cols_in = torch.repeat_interleave(torch.repeat_interleave(at_lead, at_n), per) + j
        plans.append((parent, {}, (rows_in, cols_in, rows_out, cols_out)))

    def at(cache: dict, index: tuple, device: torch.device) -> tuple:
        if device not in cache:
            cache[device] = tuple(t.to(device) for t in index)
        return cache[device]

    layers = []
    for i, (k0, _) in enumerate(ref):
        pair = []
        for part in (0, 1):
            out = k0.new_zeros((R, k0.shape[1], C, k0.shape[3]))
            for parent, cache, index in plans:
                rows_in, cols_in, rows_out, cols_out = at(cache, index, out.device)
                out[rows_out, :, cols_out] = parent[i][part][rows_in, :, cols_in]
            pair.append(out)
        layers.append((pair[0], pair[1]))
    return tuple(layers)
