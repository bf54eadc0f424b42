"""One ``llama_decode`` for many rows: every row's new tokens, each with its sequence id and position, no padding.

A row is a :class:`DecodeRow`: a :class:`~.sequences.KVView` and the tokens that follow it, and which of them
need logits. :func:`decode` decodes once a prefix rows from no cells share (``prefill.py``), plans where each row's
cells go (its own sequence when no longer view of it lives, else a fork that shares the prefix), checks
sliding-window rows can be extended, fills one ``llama_batch`` from numpy arrays, decodes it in chunks of
``n_batch`` tokens, and returns the requested logits (copied out of llama.cpp's buffer, which the next decode
overwrites: ``outputs.py``) with one new view per row.

Failures leave every view as it was: the cells a failed decode added are removed (``seq_rm`` beyond each row's
old length, where no live view reaches). ``llama_decode`` returning 1 (no free KV cell) spills idle sequences to
host bytes and retries once, then raises :class:`~continuum.errors.KVCacheFullError`; 2 (aborted) and other
codes raise :class:`~continuum.errors.BackendError`.

Example:
    >>> pool = SequencePool.of(model)                                            # doctest: +SKIP
    >>> out = decode(pool, [DecodeRow(pool.empty(), [1, 403, 87]), DecodeRow(pool.empty(), [1, 9])])  # doctest: +SKIP
    >>> out.logits.shape, out.row(1).shape, out.views[0].n_tokens          # doctest: +SKIP
    ((2, 512), (1, 512), 3)
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import BackendError, ContextLengthError, GeneratorArgumentError, KVCacheFullError
from . import cells, prefill, recurrent, window
from ._lib import lib, mark_decoded
from .outputs import Outputs
from .seq import Seq
from .sequences import KVView, SequencePool

__all__ = ["DecodeRow", "DecodeResult", "decode"]

Wanted = str | Sequence[int]


@dataclass
class DecodeRow:
    """A view and the tokens to decode after it.

    Attributes:
        view: the state's KV (its positions are ``0 .. view.n_tokens-1``; the tokens take the next ones).
        tokens: the new token ids.
        logits: which new tokens need logits: ``"last"`` (default), ``"all"``, ``"none"``, or indices into ``tokens``.
    """

    view: KVView
    tokens: Sequence[int]
    logits: Wanted = "last"


@dataclass
class DecodeResult:
    """What :func:`decode` returns.

    Attributes:
        views: one new view per row, in input order (a row without tokens keeps its view).
        logits: float32 ``(n_outputs, n_vocab)``: every row's requested logits, rows in input order, a row's
            outputs in token order (a copy: later decodes do not change it).
        offsets: ``n_rows + 1`` indices: row ``i``'s logits are ``logits[offsets[i]:offsets[i+1]]``.
    """

    views: list[KVView]
    logits: np.ndarray
    offsets: list[int] = field(default_factory=list)

    def row(self, i: int) -> np.ndarray:
        """Row ``i``'s logits, ``(n_requested, n_vocab)``."""
        return self.logits[self.offsets[i]:self.offsets[i + 1]]


class _BatchBuffers:
    """One ``llama_batch`` of ``capacity`` tokens over numpy arrays: ``seq_id[i]`` points into one int32 array."""

    def __init__(self, capacity: int):
        L = lib()
        self.capacity = capacity
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.seq_ptrs = (self.seq.ctypes.data + 4 * np.arange(capacity, dtype=np.uint64)).astype(np.uint64)
        self.out = np.zeros(capacity, np.int8)
        self.batch = L.llama_batch()
        self.batch.token = self.token.ctypes.data_as(ctypes.POINTER(L.llama_token))
        self.batch.embd = None
        self.batch.pos = self.pos.ctypes.data_as(ctypes.POINTER(L.llama_pos))
        self.batch.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.batch.seq_id = ctypes.cast(self.seq_ptrs.ctypes.data, ctypes.POINTER(ctypes.POINTER(L.llama_seq_id)))
        self.batch.logits = self.out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.outputs = Outputs()  # the arrays the logits are copied into, reused once nothing reads them


def _buffers(pool: SequencePool) -> _BatchBuffers:
    if pool.batch_buffers is None:
        pool.batch_buffers = _BatchBuffers(pool.model.n_batch)
    return pool.batch_buffers


def _wanted(row: DecodeRow, i: int) -> np.ndarray:
    k, want = len(row.tokens), row.logits
    flags = np.zeros(k, np.int8)
    if want == "last":
        flags[-1:] = 1
    elif want == "all":
        flags[:] = 1
    elif want == "none":
        pass
    elif isinstance(want, str):
        raise GeneratorArgumentError(f"row {i}: logits must be 'last', 'all', 'none' or token indices, got {want!r}")
    else:
        idx = np.asarray(list(want), dtype=np.int64)
        if idx.size and (idx.min() < -k or idx.max() >= k):
            raise GeneratorArgumentError(f"row {i}: logits indices {list(want)} outside its {k} new tokens")
        flags[idx] = 1
    return flags


def decode(pool: SequencePool, rows: Sequence[DecodeRow]) -> DecodeResult:
    """Decode every row's tokens in one ``llama_decode`` (chunked; a shared prefix first): the module docstring.

    Raises:
        StaleWindowError: sliding-window rows whose window cells are gone (``.rows``); nothing was decoded.
        ContextLengthError: a row would pass the model's context length.
        KVCacheFullError: no KV cells left, even after spilling idle sequences.
        BackendError: llama.cpp aborted or failed the decode.
    """
    with pool.model.lock:
        pool.collect()
        rows, shared = prefill.share(pool, rows, decode)  # (rows from no cells with a common prefix: it goes once)
        try:
            return _decode(pool, rows)
        finally:
            for view in shared:
                view.release()


def _decode(pool: SequencePool, rows: Sequence[DecodeRow]) -> DecodeResult:
    model, n_vocab = pool.model, pool.model.n_vocab
    toks, flags = [], []
    for i, row in enumerate(rows):
        pool.check(row.view)
        t = np.asarray(list(row.tokens), dtype=np.int64)
        if t.size and (t.min() < 0 or t.max() >= n_vocab):
            raise GeneratorArgumentError(f"row {i}: token ids must be in [0, {n_vocab}), got {t.min()}..{t.max()}")
        if row.view.n_tokens + t.size > model.context_length:
            raise ContextLengthError(f"row {i}: {row.view.n_tokens} + {t.size} tokens exceed the model's context of "
                                     f"{model.context_length} (n_ctx={model.n_ctx}, trained {model.n_ctx_train})")
        toks.append(t.astype(np.int32))
        flags.append(_wanted(row, i) if t.size else np.zeros(0, np.int8))
    counts = [int(f.sum()) for f in flags]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
    targets, forks = _plan(pool, rows)
    try:
        logits = _run(pool, rows, targets, toks, flags, offsets[-1])
    except BaseException:
        for fork in forks:
            discard(pool, fork)
        raise
    views = []
    for row, target, new in zip(rows, targets, toks):
        if target is None:
            views.append(row.view)
            continue
        target.extent = row.view.n_tokens + len(new)
        views.append(KVView(pool, target, target.extent))
    return DecodeResult(views, logits, offsets)


def discard(pool: SequencePool, seq: Seq) -> None:
    """Free a sequence no view holds (a fork made for a decode that failed)."""
    if seq.id is not None and not seq.holders:
        pool.release_id(seq.id)
        seq.id = None


def _plan(pool: SequencePool, rows: Sequence[DecodeRow]) -> tuple[list[Seq | None], list[Seq]]:
    """The sequence each row decodes into: its own (in place) when no live view of it is longer and no earlier
    row took it, else a fork. Raises StaleWindowError (after undoing the forks) for rows missing window cells."""
    pinned: list[Seq] = [r.view.seq for r in rows if r.view.seq is not None]
    targets: list[Seq | None] = []
    forks: list[Seq] = []
    claimed: set[int] = set()
    stale: list[int] = []
    try:
        for i, row in enumerate(rows):
            view, src = row.view, row.view.seq
            if not len(row.tokens):
                targets.append(None)
                continue
            fork = src is not None and (id(src) in claimed or src.longest > view.n_tokens)
            if src is None:
                seq = pool.new_seq(pinned)
                forks.append(seq)
            elif fork and (seq := window.fork_spilled(pool, src, view.n_tokens, pinned)) is not None:
                forks.append(seq)  # (a short view of a long spilled state: only its positions restored)
                if not window.fits(pool, seq.id, view.n_tokens):
                    stale.append(i)  # (window.holds read the bytes: never expected; a wrong log-prob if missed)
                    targets.append(None)
                    continue
            else:
                spilled = src.id is None
                pool.ensure_resident(src, pinned)
                if not window.fits(pool, src.id, view.n_tokens):  # type: ignore[arg-type]
                    stale.append(i)
                    targets.append(None)
                    continue
                if not fork:
                    if src.extent > view.n_tokens:  # a dead tail no live view reaches
                        window.cut_tail(pool, src, view.n_tokens)
                    elif spilled and pool.model.hybrid:  # (restored: a state ending here stays continuable once this
                        recurrent.keep_end(pool, src)  # row extends it in place; resident ones: recurrent.stale)
                    seq = src
                else:
                    seq = pool.new_seq(pinned)
                    forks.append(seq)
                    pool.share(src, seq, view.n_tokens)
            claimed.add(id(seq))
            pinned.append(seq)
            targets.append(seq)
    except BaseException:
        for seq in forks:
            discard(pool, seq)
        raise
    if stale:
        for seq in forks:
            discard(pool, seq)
        raise window.gone(pool, stale)
    return targets, forks


def _needed(rows: Sequence[DecodeRow], targets: list[Seq | None]) -> tuple[list[Seq], list[Seq]]:
    """The sequences a decode needs resident (its targets, and the views of rows it does not extend), and those it
    only forked from (``spare``): the fork reads their cells, so the rest of them may be spilled to make room (a
    cut of a state that fills the pool needs only its prefix and its new tokens' cells)."""
    pinned = [t for t in targets if t is not None]
    pinned += [r.view.seq for r, t in zip(rows, targets) if t is None and r.view.seq is not None]
    keep = {id(s) for s in pinned}
    spare = [r.view.seq for r in rows if r.view.seq is not None and id(r.view.seq) not in keep]
    return pinned, spare


def _run(pool: SequencePool, rows: Sequence[DecodeRow], targets: list[Seq | None], toks: list[np.ndarray],
         flags: list[np.ndarray], n_out: int) -> np.ndarray:
    """Fill and decode the batch in chunks; on failure remove what was added (retrying once after spilling idle
    sequences when llama.cpp found no free cell)."""
    L, model = lib(), pool.model
    live = [(seq, row.view.n_tokens, t, f) for row, seq, t, f in zip(rows, targets, toks, flags) if seq is not None]
    if not live:
        return np.zeros((0, model.n_vocab), np.float32)
    token = np.concatenate([t for _, _, t, _ in live])
    pos = np.concatenate([np.arange(n, n + len(t), dtype=np.int32) for _, n, t, _ in live])
    out = np.concatenate([f for _, _, _, f in live])
    logits = _buffers(pool).outputs.take(n_out, model.n_vocab)
    pinned, spare = _needed(rows, targets)
    cells.make_room(pool, len(token), pinned, spare)  # (room before the decode: a failed decode is the exception path)
    if model.hybrid and len(decode_chunks(pool, np.concatenate([np.full(len(t), s.id, np.int32)
                                                                for s, _, t, _ in live]))) > 1:
        for seq, n, _, _ in live:  # (a later chunk may fail after earlier ones committed: undo needs each row's summary)
            if n == seq.extent:
                recurrent.keep_end(pool, seq)
    for attempt in range(2):
        ids = np.concatenate([np.full(len(t), seq.id, np.int32) for seq, _, t, _ in live])
        rc = _decode_chunks(pool, token, pos, ids, out, logits)
        if rc == 0:
            return logits
        for seq, n, _, _ in live:  # undo: cells beyond each row's old length belong to no live view
            window.check_cut(pool, seq, n, int(L.llama_memory_seq_pos_max(model.memory, seq.id)) + 1)
            if not L.llama_memory_seq_rm(model.memory, seq.id, n, -1):  # a hybrid's summary moved on (an abort)
                recurrent.undo(pool, seq, n)
        if rc != 1:
            raise BackendError(f"llama_decode failed (code {rc}: {'aborted' if rc == 2 else 'error'}); states unchanged")
        window.check_lost(pool, [(i, seq, row.view.n_tokens) for i, (row, seq) in enumerate(zip(rows, targets))
                                 if seq is not None])  # (never decoded again over gaps)
        if attempt == 0 and not cells.spill_every_idle(pool, pinned):
            break
    raise KVCacheFullError(f"llama.cpp has no free KV cell for {len(token)} new tokens (n_ctx={model.n_ctx} cells shared "
                           "by every live state): load the model with a larger n_ctx, or keep fewer long states alive")


# Query rows per tile of llama.cpp's CPU flash attention (GGML_FA_TILE_Q): a micro-batch of this many rows or more
# takes the tiled kernel, which skips a block of cells only when every row of its tile masks it. Rows of different
# sequences in one tile therefore attend (masked, but computed) over every live sequence's cells: in a unified pool a
# step's cost grows as rows x all cells. Below it, the per-row kernel skips each masked cell. Measured on Gemma 3 270M,
# 2 threads, a 128-row step over 128 x 61 cells: 1.45 s in one micro-batch, 0.95 s in chunks under 64 rows.
FA_TILE_ROWS = 64
# Runs of this many tokens or more (prompts, long appends) are packed into decodes of up to n_batch tokens: 128
# prompts of ~22 tokens took 64 decodes of ~46 tokens (4.0-4.1 s on Gemma 3 270M, 2 threads) in chunks under the
# tile, 8 decodes of ~400 tokens packed (3.0-3.3 s). A tile of 64 rows then spans at most 5 sequences.
PACK_FROM = 16


def chunks(ids: np.ndarray, step: int, pack_from: int | None = None) -> list[tuple[int, int]]:
    """``(start, end)`` ranges of the batch, each one ``llama_decode`` of at most ``step`` tokens: a sequence's run of
    ``FA_TILE_ROWS`` tokens or more (a prefill) goes alone, cut at ``step`` (its rows mask nothing but the causal
    future: the tiled kernel skips other sequences' cells); shorter runs (one-token steps, short appends) are
    packed into balanced chunks of fewer than ``FA_TILE_ROWS`` tokens, never cutting a run. With ``pack_from``,
    consecutive runs of at least that many tokens (prompts) are packed together up to ``step`` instead: a tile of
    ``FA_TILE_ROWS`` rows then spans a few sequences, whose cells the tiled kernel computes, and skips the rest.

    >>> chunks(np.array([0] * 70 + list(range(1, 101))), 512)
    [(0, 70), (70, 120), (120, 170)]
    >>> chunks(np.array([0] * 20 + [1] * 30 + [2] * 40 + [3, 4]), 512, pack_from=16)
    [(0, 90), (90, 92)]
    """
    n = len(ids)
    if n == 0:
        return []
    cuts = np.flatnonzero(np.diff(ids)) + 1
    bounds = np.concatenate([[0], cuts, [n]]).tolist()
    runs = list(zip(bounds[:-1], bounds[1:]))
    wide = FA_TILE_ROWS if pack_from is None else min(pack_from, FA_TILE_ROWS)
    small = sum(e - s for s, e in runs if e - s < wide)
    parts = math.ceil(small / (FA_TILE_ROWS - 1))  # the fewest chunks under the tile, then balanced:
    target = math.ceil(small / parts) if parts else 0  # 128 rows -> 43, 43, 42
    out: list[tuple[int, int]] = []
    open_start: int | None = None  # an open chunk of short runs
    packed: int | None = None  # an open chunk of wide runs (pack_from)
    for s, e in runs:
        if e - s >= wide or e - s > step:
            if open_start is not None:
                out.append((open_start, s))
                open_start = None
            if pack_from is None:
                out.extend((a, min(a + step, e)) for a in range(s, e, step))
                continue
            if packed is not None and e - packed > step:
                out.append((packed, s))
                packed = None
            if packed is None:
                while e - s > step:
                    out.append((s, s + step))
                    s += step
                packed = s
            continue
        if packed is not None:
            out.append((packed, s))
            packed = None
        if open_start is not None and (e - open_start > target or e - open_start > step):
            out.append((open_start, s))
            open_start = None
        if open_start is None:
            open_start = s
    last = open_start if open_start is not None else packed
    if last is not None:
        out.append((last, n))
    return out


def decode_chunks(pool: SequencePool, ids: np.ndarray) -> list[tuple[int, int]]:
    """The decodes a batch of sequence ``ids`` takes in ``pool`` (:func:`chunks`)."""
    step = _buffers(pool).capacity
    if pool.scratch is None:
        return chunks(ids, step, PACK_FROM)
    # the batch-invariant mode: no micro-batch reaches the tiled kernel, whose sums follow where a row's cells lie and
    # which rows share its tiles, so a prompt's positions round alike however they are split into decodes (a
    # prefix-cache hit, a chunked prefill) and wherever its cells land in the pool; one token of room for the scratch
    return chunks(ids, min(step - 1, FA_TILE_ROWS - 1))


def _decode_chunks(pool: SequencePool, token: np.ndarray, pos: np.ndarray, ids: np.ndarray, out: np.ndarray,
                   logits: np.ndarray) -> int:
    L, model = lib(), pool.model
    buf, ctx, done = _buffers(pool), model.ctx, 0
    for start, end in decode_chunks(pool, ids):
        k = end - start
        buf.token[:k], buf.pos[:k], buf.seq[:k], buf.out[:k] = token[start:end], pos[start:end], ids[start:end], out[start:end]
        m = int(out[start:end].sum())
        n, extra = k, -1
        if pool.scratch is not None and (k == 1 or m == 1):
            # llama.cpp's matmuls take other kernels for a single row (tinyBLAS needs two): a lone token, or a lone
            # output row (the output projection runs over outputs only), is padded to two, as in any merged step.
            if k == 1:
                buf.token[1], buf.pos[1], buf.seq[1], buf.out[1] = token[start], 0, pool.scratch, m
                n, extra = 2, (1 if m else -1)
            else:
                extra = int(np.flatnonzero(buf.out[:k] == 0)[0])
                buf.out[extra] = 1
        buf.batch.n_tokens = n
        mark_decoded()
        rc = int(L.llama_decode(ctx, buf.batch))
        if n > k:
            L.llama_memory_seq_rm(model.memory, pool.scratch, -1, -1)
        if rc != 0:
            return rc
        if m:
            ptr: Any = L.llama_get_logits(ctx)
            got = np.ctypeslib.as_array(ptr, shape=(m + (extra >= 0), model.n_vocab))
            if extra >= 0:  # outputs are in batch order: drop the padding's row
                got = np.delete(got, int(buf.out[:extra].sum()), axis=0)
            logits[done:done + m] = got
            done += m
    return 0
