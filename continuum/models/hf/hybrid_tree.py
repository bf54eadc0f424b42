"""Choice scoring's token tree on a hybrid or recurrent model (LFM2, Mamba): the tree run level by level.

On attention models a token tree (:mod:`continuum.models.token_tree`) is one forward: each node attends to the
row's context and its own ancestors. A recurrent layer has no such mask: a node's summary is its parent's summary
updated by its token, so the tree runs **one level per forward**: level ``d``'s nodes, every row's at once, each
as a one-token row on its parent's summary and its ancestors' attention columns. The nodes computed are the tree's
(options sharing a prefix share its nodes), in ``depth + 1`` forwards; each node's logits, attention columns and
summary are exactly those of its option alone after the context.

The forward's KV is a :class:`TreeKV`: the tree's attention columns laid out as the tree forward's (column
``cached + j`` is node ``j``) and every node's summary, so :meth:`TreeKV.gather_paths` gives a chosen (row, option)
pair its own :class:`~.recurrent.HybridKV`: the context and path columns, and the summary after the path's last
cached node.

Example:
    >>> mood = continuous(generate.choice(lfm2_model, [" happy", " sad"]))      # doctest: +SKIP
    >>> mood(state).value                                                       # doctest: +SKIP
    ' sad'
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import RecurrentStateError
from . import cache as _hf
from .recurrent import HybridKV, Snapshot, States

__all__ = ["TreeKV", "tree_forward"]


class TreeKV:
    """A token tree forward's KV on a hybrid model (see the module docstring): only :meth:`gather_paths` reads it.

    ``attn``: ``(rows, heads, cached + T, dim)`` per attention layer; ``mask``: bool ``(rows, cached + T)``;
    ``nodes``: per recurrent layer, its tensors with a ``(rows, T)`` lead (the summary after each node)."""

    __slots__ = ("attn", "mask", "nodes")

    def __init__(self, attn: _hf.KV, mask: torch.Tensor, nodes: States):
        self.attn, self.mask, self.nodes = attn, mask, nodes

    def length(self) -> int:
        return int(self.mask.shape[1])

    def nbytes(self, seen: set | None = None) -> int:
        seen = set() if seen is None else seen
        total = _hf.nbytes(self.attn, seen) if self.attn else 0
        return total + sum(t.untyped_storage().nbytes() for layer in self.nodes for t in layer)

    def gather_paths(self, rows: torch.Tensor, start: int, split: int, index: torch.Tensor,
                     mask: torch.Tensor) -> HybridKV | None:
        """Each chosen pair's KV: row ``rows[j]``'s columns ``[start, split)`` then its tree columns ``split +
        index[j]``; its summary is the one after node ``index[j, -1]`` (the path's last cached node; holes are on
        the left)."""
        width = split - start + index.shape[1]
        if width <= 0:
            return None
        attn = _hf.gather_paths(self.attn, rows, start, split, index) if self.attn else ()
        r, last = rows.to("cpu", torch.long), index[:, -1].to("cpu", torch.long)
        states = tuple(tuple(t[r.to(t.device), last.to(t.device)] for t in layer) for layer in self.nodes)
        return HybridKV(attn, mask[:, :width], Snapshot(width, states, end=True), settled=True)

    def _refuse(self, *args: Any) -> Any:
        raise RecurrentStateError("a token tree's KV is read by gather_paths only (choice scoring)")

    select_rows = crop = keep = narrow = settle = _refuse


def tree_forward(adapter: Any, spec: Any, run_level, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, kv: HybridKV | None, allowed: torch.Tensor,
                 logits: str) -> tuple[torch.Tensor | None, TreeKV]:
    """The tree's nodes level by level (see the module docstring). ``run_level(ids, mask, pos, sub_kv)`` runs one
    level's one-token rows on ``sub_kv`` and returns ``(logits (B, 1, V), attention KV, states)``."""
    R, T = input_ids.shape
    C = attention_mask.shape[1] - T
    real = attention_mask[:, C:].bool().cpu()
    tree = allowed[:, :, C:].bool().cpu() & real[:, None, :] & real[:, :, None]
    depth = tree.sum(2) - 1  # (rows, T): ancestors, itself included, minus one; -1 for padding nodes
    ctx = kv.mask if kv is not None else attention_mask[:, :C].bool()
    out = torch.zeros((R, T, adapter.vocab_size), device=input_ids.device) if logits == "all" else None
    attn_cols: list[list[torch.Tensor]] = []  # per level: each attention layer's node columns (B, H, 1, D)
    placed: list[tuple[torch.Tensor, torch.Tensor]] = []  # per level: (rows, nodes) of its batch
    level_states: list[States] = []
    where = torch.full((R, T), -1, dtype=torch.long)  # node -> its row in its level's batch
    prev: HybridKV | None = None
    for d in range(int(depth.max()) + 1):
        rows, nodes = (depth == d).nonzero(as_tuple=True)
        where[rows, nodes] = torch.arange(rows.numel())
        if d == 0:
            sub = kv.select_rows(rows) if kv is not None else None
        else:
            parent = torch.where(tree[rows, nodes], torch.arange(T), -1)  # the ancestors' indices
            parent = parent.masked_fill(parent == nodes[:, None], -1).amax(1)  # the deepest other one: the parent
            assert prev is not None
            sub = prev.select_rows(where[rows, parent])
        dr, dn = rows.to(input_ids.device), nodes.to(input_ids.device)
        mask = torch.cat([ctx[rows.to(ctx.device)].to(attention_mask.dtype),
                          torch.ones((rows.numel(), d + 1), dtype=attention_mask.dtype, device=ctx.device)], 1)
        lg, attn, states = run_level(input_ids[dr, dn][:, None], mask.to(attention_mask.device),
                                     position_ids[dr, dn][:, None], sub)
        if out is not None:
            out[dr, dn] = lg[:, -1]
        attn_cols.append([k[:, :, -1:] for k, _ in attn] + [v[:, :, -1:] for _, v in attn])
        placed.append((rows, nodes))
        level_states.append(states)
        prev = HybridKV(attn, mask.bool(), Snapshot(C + d + 1, states))
    with adapter._count_lock:
        adapter.tokens_computed += int(real.sum())
    return out, TreeKV(_tree_attn(kv, attn_cols, placed, R, C, T, len(spec.attn)), attention_mask.bool(),
                       _tree_states(level_states, placed, R, T))


def _tree_attn(kv: HybridKV | None, cols: list, placed: list, R: int, C: int, T: int, layers: int) -> _hf.KV:
    """The attention KV in the tree forward's layout: the context's columns, then node ``j`` at ``C + j`` (zeros
    for padding nodes: never attended to)."""
    if not layers:
        return ()
    out = []
    for i in range(layers):
        like = cols[0][i]
        K = like.new_zeros((R, like.shape[1], C + T, like.shape[3]))
        V = torch.zeros_like(K)
        if kv is not None and C:
            K[:, :, :C], V[:, :, :C] = kv.attn[i]
        for level, (rows, nodes) in zip(cols, placed):
            r, n = rows.to(K.device), (nodes + C).to(K.device)
            K[r, :, n] = level[i][:, :, 0]
            V[r, :, n] = level[layers + i][:, :, 0]
        out.append((K, V))
    return tuple(out)


def _tree_states(levels: list[States], placed: list, R: int, T: int) -> States:
    """Every node's summary, per recurrent layer a tensor with a ``(rows, T)`` lead (zeros for padding nodes)."""
    out = []
    for i, layer in enumerate(levels[0]):
        tensors = []
        for j, t in enumerate(layer):
            full = t.new_zeros((R, T, *t.shape[1:]))
            for states, (rows, nodes) in zip(levels, placed):
                full[rows.to(full.device), nodes.to(full.device)] = states[i][j]
            tensors.append(full)
        out.append(tuple(tensors))
    return tuple(out)
