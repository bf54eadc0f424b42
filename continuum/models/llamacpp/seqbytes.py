"""One llama.cpp sequence as bytes (``llama_state_seq_get_data`` / ``set_data``): what a spill writes to host memory
and a restore, or a loaded state file, writes back (into whatever free cells llama.cpp finds)."""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import numpy as np

from ...errors import BackendError
from ._lib import lib

__all__ = ["get", "set_", "repack", "cut", "tail", "positions"]


def get(model: Any, seq_id: int) -> bytes:
    """Sequence ``seq_id``'s cells as llama.cpp writes them (shared cells included)."""
    L, ctx = lib(), model.ctx
    size = int(L.llama_state_seq_get_size(ctx, seq_id))
    buf = (ctypes.c_uint8 * size)()
    n = int(L.llama_state_seq_get_data(ctx, buf, size, seq_id))
    if n != size:
        raise BackendError(f"llama_state_seq_get_data wrote {n} bytes, expected {size}")
    return bytes(buf)


def set_(model: Any, seq_id: int, blob: bytes) -> None:
    """Write ``blob`` into sequence ``seq_id`` (emptied first); a :class:`BackendError` if llama.cpp refuses it."""
    L = lib()
    buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    if int(L.llama_state_seq_set_data(model.ctx, buf, len(blob), seq_id)) == 0:
        L.llama_memory_seq_rm(model.memory, seq_id, -1, -1)
        raise BackendError("llama.cpp refused the sequence bytes (another model, KV type or flash-attention "
                           "setting, or no room in the KV cache): recompute the state from its tokens")


def repack(model: Any) -> None:
    """Every cell of the context written out and read back (``llama_state_get_data`` / ``set_data``, the whole
    context): llama.cpp loads them packed at cells ``0 .. n-1`` in their order, shared cells shared, every sequence's
    positions as they were. The batch-invariant mode's compaction (``cells.flush``): the holes a spill or a flush
    left are gone, so new tokens land above every live cell, in position order."""
    L, ctx = lib(), model.ctx
    size = int(L.llama_state_get_size(ctx))
    buf = (ctypes.c_uint8 * size)()
    n = int(L.llama_state_get_data(ctx, buf, size))
    if n != size or int(L.llama_state_set_data(ctx, buf, n)) != n:
        raise BackendError("llama.cpp could not write the context's cells back while packing them; the model's states "
                           "must be recomputed")


_MAGIC = 0xAF143CD8  # (llama-context.cpp: io_magic, before the source seq id)


class _Layout(ValueError):
    """The bytes are not in the layout :func:`cut` reads."""


def cut(blob: bytes, n: int) -> bytes | None:
    """``blob`` (:func:`get`'s bytes of one sequence) with only its cells at positions below ``n``: what ``get``
    returns after ``seq_rm(seq, n, -1)``. A spilled sequence whose longest view was dropped restores only the cells
    its views reach (its whole bytes took cells it does not need: a restore that fitted was refused). None where the
    bytes are not the attention caches' layout this reads: a header ``0xaf143cd8, seq_id`` (newer llama.cpp), then
    ``llama_kv_cache::state_write``'s, one section per cache: ``n_stream``; per stream ``cell_count``, the cells'
    ``(pos, 1, seq_id)``, ``v_trans``, ``n_layer``, each layer's K rows, then V rows (or V element columns when
    transposed). Every byte must be read exactly, so a layout this does not know (a recurrent cache, M-RoPE
    positions, another llama.cpp) gives None: keep the blob."""
    return _select(blob, 0, n)


def tail(blob: bytes, n: int) -> bytes | None:
    """``blob`` with only its cells at positions ``n`` and above: what ``get`` returns after ``seq_rm(seq, 0, n)``. A
    restored member of a fork family is written as its own cells from ``n`` on, its first ``n`` positions shared from
    a resident relative (``reshare.restore``: writing them too took the prefix's cells twice, and a restore that fits
    beside the relative was refused). None as for :func:`cut`."""
    return _select(blob, n, None)


def positions(blob: bytes) -> list[np.ndarray] | None:
    """The positions of the cells ``blob`` holds, one array per cache (an iSWA model's base cache, then its window
    cache: llama.cpp writes a window cache's cells that are not masked behind the sequence's last position, and
    ``find_slot`` may already have given the oldest of them to other tokens). None as for :func:`cut`."""
    held: list[np.ndarray] = []
    return held if _select(blob, 0, 0, held) is not None else None  # (no cell selected: the offsets walked only)


def _select(blob: bytes, lo: int, hi: int | None, held: list | None = None) -> bytes | None:
    """``blob`` with only its cells at positions ``lo <= pos < hi`` (``hi`` None: no upper end); each section's cell
    positions appended to ``held`` if given."""
    try:
        view, out, off = memoryview(blob), [], 0
        if len(view) >= 8 and struct.unpack_from("<I", view)[0] == _MAGIC:
            out.append(bytes(view[:8]))
            off = 8
        while off < len(view):
            off = _section(view, off, lo, hi, out, held)
    except (_Layout, struct.error, ValueError):
        return None
    return b"".join(out)


def _take(view: memoryview, off: int, fmt: str) -> tuple[Any, int]:
    size = struct.calcsize(fmt)
    if off + size > len(view):
        raise _Layout("truncated")
    return struct.unpack_from(fmt, view, off), off + size


def _rows(view: memoryview, off: int, shape: tuple[int, ...]) -> tuple[np.ndarray, int]:
    size = int(np.prod(shape))
    if off + size > len(view):
        raise _Layout("truncated")
    return np.frombuffer(view, np.uint8, size, off).reshape(shape), off + size


def _section(view: memoryview, off: int, lo: int, hi: int | None, out: list[bytes], held: list | None = None) -> int:
    """One cache's section from ``off``, its cells at positions ``lo <= pos < hi`` appended to ``out`` (with ``held``:
    only its cells' positions appended there); returns the offset after it."""
    (n_stream,), off = _take(view, off, "<I")
    if not 1 <= n_stream <= 256:
        raise _Layout("n_stream")
    out.append(struct.pack("<I", n_stream))
    for _ in range(n_stream):
        (count,), off = _take(view, off, "<I")
        if count == 0:
            out.append(struct.pack("<I", 0))
            if held is not None:
                held.append(np.zeros(0, np.int32))
            continue
        meta, off = _rows(view, off, (count, 12))
        cells = meta.view("<i4")
        if not (cells[:, 1] == 1).all():
            raise _Layout("a cell of several sequences")  # (the whole context's layout, or positions with an ext)
        if held is not None:
            held.append(cells[:, 0].copy())
        keep = cells[:, 0] >= lo
        if hi is not None:
            keep &= cells[:, 0] < hi
        kept = int(keep.sum())
        out.append(struct.pack("<I", kept))
        (v_trans, n_layer), off = _take(view, off, "<II")
        if v_trans > 1 or not 0 < n_layer <= 4096:
            raise _Layout("v_trans, n_layer")
        parts = [meta[keep].tobytes(), struct.pack("<II", v_trans, n_layer)]
        for _k_or_v in range(1 if v_trans else 2):
            for _layer in range(n_layer):
                head, off = _take(view, off, "<iQ")
                rows, off = _rows(view, off, (count, head[1]))
                parts += [struct.pack("<iQ", *head), rows[keep].tobytes()]
        if v_trans:
            for _layer in range(n_layer):
                head, off = _take(view, off, "<iII")
                cols, off = _rows(view, off, (head[2], count, head[1]))
                parts += [struct.pack("<iII", *head), cols[:, keep].tobytes()]
        if kept:  # (llama.cpp writes nothing after a stream's count of 0)
            out.extend(parts)
    return off
