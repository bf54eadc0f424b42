"""Choice scoring's token trees on llama.cpp: every option of a row decoded in ONE ``llama_decode``, each tree node
once, the way llama.cpp does tree (speculative) decoding.

A tree request (:class:`~continuum.models.request.Request` with ``allowed``, built by
:mod:`continuum.models.token_tree`) holds, per row, a root (the row's last token) and the trie of its options.
llama.cpp's batch lets one token belong to several sequences (``llama_batch.seq_id[i]`` is an array). So each row
gets one sequence per *leaf* of its trie (a fork of the row's view, ``seq_cp``: cells shared, nothing copied), and
each node is decoded once, at its position, with the ids of every leaf below it: a node attends to the row's
context and its own ancestors only, as ``allowed`` says. An option that is a prefix of another ends inside a leaf's
path: its KV is a shorter view of that leaf's sequence. The tree is read from ``allowed`` (node ``i`` sees node
``j``: ``j`` is an ancestor of ``i``), so the loop's token tree stays backend-neutral.

The forward's KV is a :class:`TreeKV`; :meth:`TreeKV.gather_paths` (reached through
:func:`continuum.models.kv.gather_paths`) gives each chosen (row, option) pair the view of its leaf's sequence
covering the context, the root and the option's tokens but the last. Leaves nobody chose are released when the
``TreeKV`` is dropped (the pool's refcounting).

Limits: the leaves of one tree request and the rows' own sequences must fit in the pool's sequence ids (at most
255): more is refused with :class:`~continuum.errors.SequencesExhaustedError` saying what to do (nothing is
decoded); several requests of one step share a decode while their leaves fit, else run one after another. Nodes
are decoded by depth, so a tree longer than a decode (``n_batch`` tokens; 63 with flash attention, under its tiled
kernel) is decoded in chunks (sequences coupled by a node then hold the same positions, as llama.cpp requires).
Sliding-window rows get the checks of any decode (:class:`~continuum.errors.StaleWindowError`).

Example:
    >>> logits, kv = model.forward(tree.ids, mask, tree.positions, state_kv, logits="all", allowed=tree.allowed)  # doctest: +SKIP
    >>> kv.gather_paths(rows, lead, C, nodes, mask[:, :-1])    # the chosen pairs' SeqKV          # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...errors import BackendError, ContinuumError, KVCacheFullError, SequencesExhaustedError
from . import cells, window
from ._lib import lib, mark_decoded
from .decode import FA_TILE_ROWS, discard
from .seq import Seq
from .sequences import KVView, SequencePool

if TYPE_CHECKING:
    from ..request import Request

__all__ = ["TreeKV", "run_trees"]


@dataclass
class _Row:
    """One row's tree: its context view, each real node's depth and the leaves below it."""

    view: KVView
    nodes: list[int]  # the real nodes, root (0) first
    depth: dict[int, int]
    tokens: dict[int, int]
    leaves: list[int]
    below: dict[int, list[int]]  # node -> indices into leaves of the leaves below it (itself included)
    wanted: set[int] | None = None  # the nodes whose logits are read (the request's ``outputs``; None: every inner node)


def _read_tree(i: int, ids: np.ndarray, real: np.ndarray, anc: np.ndarray, pos: np.ndarray, view: KVView) -> _Row:
    """Row ``i``'s tree from ``allowed``'s tree block ``anc`` (``anc[a, b]``: node ``a`` sees node ``b``); refuses a
    matrix that is not a tree rooted at node 0, or positions that do not follow the row's view."""
    nodes = np.flatnonzero(real).tolist()
    sub = anc[np.ix_(nodes, nodes)]
    depth_of = sub.sum(1) - 1
    ok = bool(nodes) and nodes[0] == 0 and depth_of[0] == 0 and bool(sub.diagonal().all()) and bool(sub[:, 0].all())
    ok = ok and not anc[np.ix_(nodes, np.flatnonzero(~real))].any()
    for a in range(1, len(nodes)) if ok else ():
        parents = [b for b in np.flatnonzero(sub[a]) if depth_of[b] == depth_of[a] - 1]
        ok = len(parents) == 1 and bool((sub[a] == (sub[parents[0]] | (np.arange(len(nodes)) == a))).all())
        if not ok:
            break
    n = view.n_tokens
    if not ok or not (pos[nodes] == n + depth_of).all():
        raise BackendError(f"row {i}: the attention matrix is not a token tree over positions {n}.. after the row's "
                           f"{n} cached tokens (llama.cpp decodes trees only; continuum.models.token_tree builds them)")
    is_leaf = sub.sum(0) == 1  # a node no other node sees
    leaf_at = np.flatnonzero(is_leaf)
    below = {v: np.flatnonzero(sub[leaf_at, k]).tolist() for k, v in enumerate(nodes)}
    return _Row(view, nodes, {v: int(d) for v, d in zip(nodes, depth_of)}, {v: int(ids[v]) for v in nodes},
                [nodes[k] for k in leaf_at], below)


def _rows_of(pool: SequencePool, r: Request) -> list[_Row]:
    r.materialize()
    R, T = r.ids.shape
    C = r.mask.shape[1] - T
    if r.kv is not None:  # (views cut to the mask's cached columns, see SeqKV.matching)
        r.kv = r.kv.matching(r.mask[:, :C])
    views = r.kv.views if r.kv is not None else [pool.empty()] * R
    real = r.mask[:, C:].bool().cpu().numpy()
    ctx = r.mask[:, :C].bool().cpu()
    assert r.allowed is not None
    allowed = r.allowed.bool().cpu()
    pos, ids = r.pos.cpu().numpy(), r.ids.cpu().numpy()
    outputs = r.outputs.bool().cpu().numpy() if r.outputs is not None else None
    rows = []
    for i in range(R):
        if not bool((allowed[i, real[i], :C] == ctx[i]).all()):
            raise BackendError(f"row {i}: its tree nodes must see exactly the row's cached context on llama.cpp")
        rows.append(_read_tree(i, ids[i], real[i], allowed[i, :, C:].numpy(), pos[i], views[i]))
        if outputs is not None:
            rows[-1].wanted = set(np.flatnonzero(outputs[i] & real[i]).tolist())
    return rows


def run_trees(backend: Any, requests: list[Request]) -> None:
    """Run token-tree requests, each one's ``result`` (logits of the nodes read, NaN at the others: see
    :func:`_decode`; :class:`TreeKV`) or ``error`` set;
    requests whose leaves fit in the free sequence ids together share one decode."""
    pool, plans = backend.pool, []
    for r in requests:
        try:
            plans.append((r, _rows_of(pool, r)))
        except Exception as exc:  # noqa: BLE001  (a malformed request fails alone)
            r.error = exc
    group: list[tuple[Request, list[_Row]]] = []
    used = 0
    for r, rows in plans:
        need = sum(len(row.leaves) for row in rows) + len({id(row.view.seq) for row in rows if row.view.seq})
        if group and used + need > pool.n_ids:
            _run_group(backend, group)
            group, used = [], 0
        group.append((r, rows))
        used += need
    if group:
        _run_group(backend, group)


def _run_group(backend: Any, group: list[tuple[Request, list[_Row]]]) -> None:
    pool, model = backend.pool, backend.pool.model
    rows = [row for _, req_rows in group for row in req_rows]
    try:
        with model.lock:
            pool.collect()
            leaf_seqs = _fork_leaves(pool, rows)
            try:
                logits, order = _decode(pool, rows, leaf_seqs)
            except BaseException:
                for seqs in leaf_seqs:
                    for seq in seqs:
                        discard(pool, seq)
                raise
            views = []
            for row, seqs in zip(rows, leaf_seqs):
                ends = [row.view.n_tokens + row.depth[leaf] + 1 for leaf in row.leaves]
                for seq, end in zip(seqs, ends):
                    seq.extent = end
                views.append([KVView(pool, seq, end) for seq, end in zip(seqs, ends)])
    except Exception as exc:  # noqa: BLE001  (to its owner: a group's failure is re-run one request at a time)
        if len(group) == 1:
            group[0][0].error = exc
        else:  # (a row's error, e.g. StaleWindowError, must not fail the other requests; Ctrl-C propagates)
            for item in group:
                _run_group(backend, [item])
        return
    out = torch.from_numpy(logits)
    first = 0
    for r, req_rows in group:
        R, T = r.ids.shape
        if r.logits == "outputs":  # row-major already: its slice, no copy
            at = [order[(first + i, node)] for i, row in enumerate(req_rows) for node in row.nodes
                  if (first + i, node) in order]
            lg = out[min(at, default=0):max(at, default=-1) + 1]
        else:
            # NaN wherever _decode computed nothing (leaves, padding): one pass over (rows, nodes, vocab)
            lg = torch.full((R, T, backend.vocab_size), float("nan"))
            for i, row in enumerate(req_rows):
                done = [node for node in row.nodes if (first + i, node) in order]
                lg[i, done] = out[[order[(first + i, node)] for node in done]]
        cols = r.kv.cols if r.kv is not None else torch.zeros((R, 0), dtype=torch.bool)
        r.result, r.error = (lg, TreeKV(req_rows, views[first:first + R], cols, T)), None
        first += R
    with backend.count_lock:
        backend.tokens_computed += sum(len(row.nodes) for row in rows)
        backend.forward_calls += 1


def _fork_leaves(pool: SequencePool, rows: list[_Row]) -> list[list[Seq]]:
    """One new sequence per leaf of every row, holding the row's context cells (``seq_cp``: shared)."""
    pinned: list[Seq] = [row.view.seq for row in rows if row.view.seq is not None]
    need = sum(len(row.leaves) for row in rows)
    if need + len({id(s) for s in pinned}) > pool.n_ids:
        raise SequencesExhaustedError(
            f"scoring these options needs {need} llama.cpp sequences (one per option path of each of {len(rows)} "
            f"rows) beside the rows' own, more than the {pool.n_ids} sequence ids: score fewer rows at once "
            "(e.g. slice the state's samples), fewer options, or use generate.choice(..., method='greedy')")
    stale, srcs, temps = [], [row.view.seq for row in rows], []
    for i, row in enumerate(rows):
        src = row.view.seq
        if src is not None:
            short = window.fork_spilled(pool, src, row.view.n_tokens, pinned) if src.longest > row.view.n_tokens else None
            if short is not None:  # (a short view of a long spilled state: only its positions restored, as decodes do)
                srcs[i] = short
                temps.append(short)
                pinned.append(short)
            else:
                pool.ensure_resident(src, pinned)
    # (every restore first, then every probe: a restore's cells may be window cells llama.cpp counts free behind
    # another row's sequence end, and a row probed before a later row's restore read them gone, silently: the stress
    # driver, window-8 GGUF, seed 1802, history 98, a choice's log-prob -40.4 where llama.cpp gives -32.6. Nothing
    # takes cells between the probes and the leaves' seq_cp below, which holds them.)
    for i, row in enumerate(rows):
        if srcs[i] is not None and not window.fits(pool, srcs[i].id, row.view.n_tokens):  # type: ignore[union-attr,arg-type]
            stale.append(i)
    out: list[list[Seq]] = []
    seqs: list[Seq] = []
    try:
        if stale:
            raise window.gone(pool, stale)
        for row, src in zip(rows, srcs):
            seqs = []
            for _ in row.leaves:
                seq = pool.new_seq(pinned)
                seqs.append(seq)
                pinned.append(seq)
                if src is not None:  # (the context's cells shared; a hybrid's summary at its end)
                    pool.share(src, seq, row.view.n_tokens)
            out.append(seqs)
    except BaseException:
        for made in out + [seqs]:
            for seq in made:
                discard(pool, seq)
        raise
    finally:
        for temp in temps:  # (its cells live on in the leaves)
            discard(pool, temp)
    return out


def _decode(pool: SequencePool, rows: list[_Row], leaf_seqs: list[list[Seq]]) -> tuple[np.ndarray, dict]:
    """Every node of every row once, by depth (ancestors first), with the ids of the leaves below it. Only the nodes
    whose logits are read output them (the request's ``outputs``; without it, the nodes with children): a leaf's
    would predict the token after its option, which choice scoring never reads (no end-of-option term), nor does it
    read the shared suffix before the options (a trunk), and on a large vocabulary each output row costs about what
    the rest of the model does for one token (Gemma 3: 262k x 640). Returns the outputs' logits in batch order and
    ``(row, node) -> index`` into them for those nodes. On failure the leaves hold only the context again (llama.cpp
    found no free cell: idle sequences are spilled and the tree is decoded again, once)."""
    model = pool.model
    items = sorted(((row.depth[node], k, node) for k, row in enumerate(rows) for node in row.nodes))
    token = np.array([rows[k].tokens[node] for _, k, node in items], np.int32)
    pos = np.array([rows[k].view.n_tokens + d for d, k, node in items], np.int32)
    reads = [row.wanted if row.wanted is not None else set(row.nodes) - set(row.leaves) for row in rows]
    wanted = np.array([node in reads[k] for _, k, node in items], np.int8)
    # the outputs are stored row-major (row by row, nodes in order), not in the batch's order (by depth): each
    # request's rows are then one slice of the array, its logits="outputs" as they are
    order = {key: i for i, key in enumerate(sorted((k, node) for k, read in enumerate(reads) for node in read))}
    dest = np.array([order[(k, node)] for _, k, node in items if (k, node) in order], np.intp)
    logits = np.empty((len(order), model.n_vocab), np.float32)
    step = model.n_batch - (pool.scratch is not None)
    if model.flash_attn:  # chunks under flash attention's tiled kernel (decode.FA_TILE_ROWS), as decodes of rows are:
        # its sums follow which rows share a tile, so a tree of 64+ nodes scored its options 3e-3 off a prefill of
        # prompt + option on the f32 fixture in either mode (60 or 100 options), and its tiles of several rows'
        # nodes compute attention over every row's cells
        step = min(step, FA_TILE_ROWS - 1)
    keep = [s for seqs in leaf_seqs for s in seqs]
    # (the rows' own sequences only lend the leaves their context: spillable, last, if the pool is full of them)
    spare = [row.view.seq for row in rows if row.view.seq is not None]
    cells.make_room(pool, len(items), keep, spare)  # (room before the decode: a failed decode is the exception path)
    for attempt in range(2):
        sets = [[int(leaf_seqs[k][li].id) for li in rows[k].below[node]] for _, k, node in items]  # type: ignore[arg-type]
        rc = 0
        for start in range(0, len(items), step):
            end = min(start + step, len(items))
            o0 = int(wanted[:start].sum())
            rc = _decode_chunk(pool, token[start:end], pos[start:end], sets[start:end], wanted[start:end], logits,
                               dest[o0:o0 + int(wanted[start:end].sum())])
            if rc != 0:
                break
        if rc == 0:
            return logits, order
        for row, seqs in zip(rows, leaf_seqs):  # back to the context: cells past it belong to no view
            for seq in seqs:
                end = int(lib().llama_memory_seq_pos_max(model.memory, seq.id)) + 1
                window.check_cut(pool, seq, row.view.n_tokens, end)  # (gaps behind the context's end: broken)
                pool.drop(seq.id, row.view.n_tokens, -1)  # type: ignore[arg-type]
        if rc != 1:
            raise BackendError(f"llama_decode failed on a token tree (code {rc}: {'aborted' if rc == 2 else 'error'}); "
                               "the states are unchanged")
        # (a leaf alone held its context's window cells once its row's sequence was spilled for room: window.py)
        window.check_lost(pool, [(k, s, row.view.n_tokens) for k, (row, seqs) in enumerate(zip(rows, leaf_seqs)) for s in seqs])
        if attempt or not cells.spill_every_idle(pool, keep):
            break
    raise KVCacheFullError(f"llama.cpp has no free KV cell for a token tree of {len(items)} nodes (n_ctx={model.n_ctx} "
                           "cells shared by every live state): load the model with a larger n_ctx, or keep fewer long "
                           "states alive")


def _decode_chunk(pool: SequencePool, token: np.ndarray, pos: np.ndarray, sets: list[list[int]], wanted: np.ndarray,
                  logits: np.ndarray, dest: np.ndarray) -> int:
    """One ``llama_decode`` of tokens with several sequence ids each, the ``wanted`` ones outputs, their logits into
    ``logits``' rows ``dest`` (a lone token padded with the scratch row in the batch-invariant mode, as ``decode.py``
    does)."""
    L, model = lib(), pool.model
    k, m = len(token), len(dest)
    out = np.array(wanted, np.int8)
    pad, extra = pool.scratch is not None and k == 1, -1
    if pad:
        token, pos, sets = np.append(token, token[0]), np.append(pos, 0).astype(np.int32), sets + [[int(pool.scratch)]]  # type: ignore[arg-type]
        out = np.append(out, np.int8(m))
        extra = 1 if m else -1
    elif pool.scratch is not None and m == 1:  # (a lone output row takes another kernel: padded to two, as decode.py)
        extra = int(np.flatnonzero(out == 0)[0])
        out[extra] = 1
    n = len(token)
    flat = np.array([s for ids in sets for s in ids], np.int32)
    counts = np.array([len(ids) for ids in sets], np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.uint64)
    ptrs = (flat.ctypes.data + 4 * starts).astype(np.uint64)
    token, pos = np.ascontiguousarray(token, np.int32), np.ascontiguousarray(pos, np.int32)
    batch = L.llama_batch()
    batch.n_tokens = n
    batch.token = token.ctypes.data_as(ctypes.POINTER(L.llama_token))
    batch.embd = None
    batch.pos = pos.ctypes.data_as(ctypes.POINTER(L.llama_pos))
    batch.n_seq_id = counts.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    batch.seq_id = ctypes.cast(ptrs.ctypes.data, ctypes.POINTER(ctypes.POINTER(L.llama_seq_id)))
    batch.logits = out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
    mark_decoded()
    rc = int(L.llama_decode(model.ctx, batch))
    if pad:
        L.llama_memory_seq_rm(model.memory, pool.scratch, -1, -1)
    if rc == 0 and m:
        ptr: Any = L.llama_get_logits(model.ctx)  # (the outputs' rows, in batch order)
        got = np.ctypeslib.as_array(ptr, shape=(m + (extra >= 0), model.n_vocab))
        if extra >= 0:
            got = np.delete(got, int(out[:extra].sum()), axis=0)
        if m and int(dest[-1]) - int(dest[0]) == m - 1 and bool((np.diff(dest) == 1).all()):
            logits[int(dest[0]):int(dest[0]) + m] = got  # (in order: one copy)
        else:
            logits[dest] = got
    return rc


class TreeKV:
    """The KV of a token-tree forward on llama.cpp (see the module docstring): per row, its context view and one
    view per leaf of its tree. Only read, by :meth:`gather_paths`; dropping it releases the leaves nobody chose."""

    __slots__ = ("rows", "leaves", "cols", "width")

    def __init__(self, rows: list[_Row], leaves: list[list[KVView]], cols: torch.Tensor, tree_width: int):
        self.rows, self.leaves, self.cols = rows, leaves, cols
        self.width = int(cols.shape[1]) + tree_width

    def __repr__(self) -> str:
        return f"TreeKV(rows={len(self.rows)}, leaves={[len(v) for v in self.leaves]})"

    def length(self) -> int:
        return self.width

    def gather_paths(self, rows: torch.Tensor, start: int, split: int, index: torch.Tensor,
                     mask: torch.Tensor) -> Any:
        """Per output row ``j``: row ``rows[j]``'s context and the tree nodes ``index[j]`` (holes, masked in
        ``mask``, on the left), as a :class:`~.seqkv.SeqKV` of ``mask``'s layout (``mask`` ``(len(rows),
        split - start + index.shape[1])``: which of the result's columns are real)."""
        from .seqkv import SeqKV

        cols = mask.bool().cpu()
        views = []
        for j, r in enumerate(rows.tolist()):
            row, n_tree = self.rows[r], int(cols[j, split - start:].sum())
            if n_tree == 0:
                view = row.view
            else:
                node = int(index[j, -1])
                if row.depth.get(node, -1) != n_tree - 1:
                    raise BackendError(f"row {r}: tree node {node} is not at depth {n_tree - 1}: not a path of this tree")
                li = row.below[node][0]
                view = self.leaves[r][li].slice(row.view.n_tokens + n_tree)
            if int(cols[j].sum()) != view.n_tokens:
                raise BackendError(f"row {j}: its mask covers {int(cols[j].sum())} tokens, its path {view.n_tokens}")
            views.append(view)
        out = SeqKV(views, cols)
        # (a hybrid: an option that is a prefix of another ends inside a leaf's sequence, where no recurrent summary
        return out.cut(cols) if self.rows and self.rows[0].view.pool.model.hybrid else out  # is kept: cut back)

    def nbytes(self, seen: set | None = None) -> int:
        from .seqkv import SeqKV

        views = [v for row in self.leaves for v in row] + [row.view for row in self.rows if row.view.seq is not None]
        return SeqKV(views, torch.zeros((len(views), 0), dtype=torch.bool)).nbytes(seen) if views else 0

    def settle(self) -> TreeKV:
        return self

    def _only_read(self, *args: Any, **kwargs: Any) -> Any:
        raise ContinuumError("a token tree's KV on llama.cpp is only read by kv.gather_paths (choice scoring)")

    select_rows = crop = keep = narrow = _only_read

    @classmethod
    def stack(cls, kvs: list, width: int, reserve: int = 0) -> Any:
        raise ContinuumError("a token tree's KV on llama.cpp cannot be stacked with other rows")
