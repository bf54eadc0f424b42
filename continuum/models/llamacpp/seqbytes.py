"""One llama.cpp sequence as bytes (``llama_state_seq_get_data`` / ``set_data``): what a spill writes to host memory
and a restore, or a loaded state file, writes back (into whatever free cells llama.cpp finds)."""

from __future__ import annotations

import ctypes
from typing import Any

from ...errors import BackendError
from ._lib import lib

__all__ = ["get", "set_", "repack"]


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
