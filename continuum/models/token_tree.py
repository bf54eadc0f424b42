"""Token trees: every option of a row scored in ONE row after its context (choice scoring).

A row's tree starts at its *root*, the row's first uncached token, then its *trunk*, the rest of the row's
uncached suffix (empty on a prefilled state, which leaves only its last token uncached), and holds every
option's tokens as a trie hanging off the trunk's end: options sharing a prefix share its nodes. So the
uncached suffix and every option are computed in ONE forward. The tree's nodes become the new columns of one
forward pass on top of the row's cached context, with

* an explicit attention matrix: a node sees the row's real context columns and its own
  ancestors (itself included), never another branch;
* explicit positions: a node at depth ``d`` sits at the root's position plus ``d``.

So each option token is computed exactly as if its option alone followed the context, and the
forward holds ``context + tree`` columns per row instead of ``options x context``: how speculative
decoders verify a tree of draft tokens. Trees of a batch are laid side by side, padded at the end
with nodes that see only themselves (their outputs are never read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["TokenTree", "build"]


@dataclass(frozen=True)
class TokenTree:
    """The tree columns of a batch of rows (``T`` columns; node 0 of every row is its root).

    ``paths[r][k]``: the node of each token of row ``r``'s option ``k``, in order (the root and trunk not included);
    ``trunks[r]``: the nodes of row ``r``'s trunk, in order (the root not included).
    """

    ids: torch.Tensor  # (rows, T) token of each node; padding nodes hold the pad token
    real: torch.Tensor  # (rows, T) 1 for nodes, 0 for padding
    positions: torch.Tensor  # (rows, T)
    allowed: torch.Tensor  # (rows, T, cached + T) bool: the columns each node attends to
    paths: list[list[list[int]]]
    trunks: list[list[int]]

    def _first(self, r: int) -> int:
        """The node that predicts row ``r``'s options' first token: the trunk's end (the root without a trunk)."""
        return self.trunks[r][-1] if self.trunks[r] else 0

    def _reads(self) -> tuple[list[int], list[int], list[int]]:
        """Per option token, row-major: its row, the node that predicts it (the trunk's end for an option's first
        token, else the node of the token before) and its own node."""
        rows: list[int] = []
        preds: list[int] = []
        nodes: list[int] = []
        for r, options in enumerate(self.paths):
            first = self._first(r)
            for path in options:
                rows += [r] * len(path)
                preds += [first, *path[:-1]] if path else []
                nodes += path
        return rows, preds, nodes

    @property
    def outputs(self) -> torch.Tensor:
        """``(rows, T)`` bool: the nodes whose logits :meth:`option_logprobs` reads (``Backend.forward``'s
        ``outputs``: a backend may leave the others uncomputed)."""
        rows, preds, _ = self._reads()
        out = torch.zeros(self.ids.shape, dtype=torch.bool)
        out[rows, preds] = True
        return out.to(self.ids.device)

    def option_logprobs(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """Per (row, option) pair, row-major: the log-prob of each of the option's tokens (token ``i`` is predicted by
        the node of token ``i - 1``, the first one by the trunk's end). ``logits``: the tree forward's
        ``logits="outputs"``, ``(nodes read, vocab)``: the rows of the nodes :attr:`outputs` marks, row-major, which
        are normalised here in place (the forward's own tensor: on Gemma's 262,144 columns a copy of them, or a
        ``(rows, nodes, vocab)`` tensor around them, cost more than the log-softmax); or ``logits="all"``'s
        ``(rows, T, vocab)``, whose nodes read are copied first."""
        rows, preds, nodes = self._reads()
        dev = logits.device
        rr, pp, nn = (torch.tensor(x, dtype=torch.long) for x in (rows, preds, nodes))
        tokens = self.ids.cpu()[rr, nn].to(dev)
        T = self.ids.shape[1]
        if logits.dim() == 3:  # every node's logits: the rows read, each once, copied out
            at, where = torch.unique(rr * T + pp, return_inverse=True)
            lp = logits.reshape(-1, logits.shape[-1]).index_select(0, at.to(dev)).float()
        else:  # (the nodes read are :attr:`outputs`' marks: each one's row among them, counted row-major)
            read = torch.zeros(self.ids.numel(), dtype=torch.long)
            read[rr * T + pp] = 1
            where = (read.cumsum(0) - 1)[rr * T + pp]
            assert logits.shape[0] == int(read.sum()), "logits='outputs' holds one row per node read"
            lp = logits if logits.dtype == torch.float32 else logits.float()
        with torch.inference_mode(lp.is_inference()):  # (a forward's own tensor may be an inference tensor)
            flat = torch.log_softmax(lp, -1, out=lp)[where.to(dev), tokens]
        return list(flat.split([len(p) for options in self.paths for p in options]))


def build(roots: Sequence[int], root_positions: Sequence[int], options: Sequence[Sequence[Sequence[int]]],
          context: torch.Tensor, pad: int, trunks: Sequence[Sequence[int]] | None = None) -> TokenTree:
    """The trees of ``len(roots)`` rows: row ``r`` is ``roots[r]`` (at ``root_positions[r]``), then the tokens
    ``trunks[r]`` (default none), then the trie of ``options[r]`` (token ids per option); ``context``
    ``(rows, cached)`` is the mask of the cached columns each node may see."""
    R = len(roots)
    trunks = trunks if trunks is not None else [[]] * R
    toks: list[list[int]] = []
    parents: list[list[int]] = []
    depths: list[list[int]] = []
    paths: list[list[list[int]]] = []
    tries: dict[tuple, tuple] = {}  # (rows with the same trunk and options, e.g. a joint call's: one trie)
    for r in range(R):
        key = (tuple(trunks[r]), tuple(map(tuple, options[r])))
        if key not in tries:
            tries[key] = _trie([list(trunks[r]) + list(o) for o in options[r]])
        tok, parent, depth, row_paths = tries[key]
        toks.append([roots[r], *tok])
        parents.append(parent)
        depths.append(depth)
        paths.append(row_paths)
    T = max(len(t) for t in toks)
    ids = torch.tensor([t + [pad] * (T - len(t)) for t in toks], dtype=torch.long)
    real = torch.tensor([[1] * len(t) + [0] * (T - len(t)) for t in toks], dtype=torch.long)
    # each node's parent; padding nodes are their own: they see only themselves
    up = torch.tensor([p + list(range(len(p), T)) for p in parents], dtype=torch.long)
    level = torch.tensor([d + [0] * (T - len(d)) for d in depths], dtype=torch.long)
    ancestors = torch.eye(T, dtype=torch.bool).repeat(R, 1, 1)
    above = torch.arange(T).repeat(R, 1)
    for _ in range(int(level.max())):  # walk every node up to the root, one level per step
        above = up.gather(1, above)
        ancestors.scatter_(2, above[:, :, None], True)
    dev = context.device
    sees_context = context.bool()[:, None, :] & real.bool().to(dev)[:, :, None]
    allowed = torch.cat([sees_context, ancestors.to(dev)], 2)
    positions = torch.tensor(list(root_positions), dtype=torch.long)[:, None] + level
    cut = [len(t) for t in trunks]  # (the trunk is each option path's first nodes: 1 .. len(trunk), made first)
    return TokenTree(ids=ids.to(dev), real=real.to(dev), positions=positions.to(dev), allowed=allowed,
                     paths=[[p[n:] for p in row] for row, n in zip(paths, cut)], trunks=[list(range(1, n + 1)) for n in cut])


def _trie(options: list[list[int]]) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """The trie of ``options`` below a root (node 0, its token not included): the tokens of nodes 1.., every node's
    parent and depth (the root's included), and each option's nodes."""
    tok: list[int] = []
    parent, depth = [0], [0]  # node 0: the root (its own parent)
    children: list[dict[int, int]] = [{}]
    paths = []
    for option in options:
        node, path = 0, []
        for t in option:
            nxt = children[node].get(t)
            if nxt is None:
                nxt = len(parent)
                tok.append(t)
                parent.append(node)
                depth.append(depth[node] + 1)
                children.append({})
                children[node][t] = nxt
            path.append(nxt)
            node = nxt
        paths.append(path)
    return tok, parent, depth, paths
