"""A remote state's KV: a handle on states stored by the server, never bytes on the client.

Each row of a state names the stored state it extends and the row of it (``(id, row)``); the KV covers the first
columns of the state's layout, as any backend's KV does, so the state algebra (``state/``) slices, selects, stacks
and adds remote states with the same code as local ones, through :class:`~continuum.models.kv.KVHandle`. How many
of a row's tokens the server's KV covers is read from the state's own mask over those columns
(``state._cached_real()``): the handle only has to keep the rows' names and the covered width in step with it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RemoteKV"]

Entry = tuple[str, int] | None  # (stored state id, its row), or None: nothing of this row is on the server


class RemoteKV:
    """The server-side KV of a remote state's rows: per row the stored state and row it extends, and the width of
    the state's layout covered (a value: every method returns a new handle)."""

    __slots__ = ("entries", "width")

    def __init__(self, entries: tuple[Entry, ...], width: int):
        self.entries, self.width = entries, width

    def __repr__(self) -> str:
        named = sorted({e[0][:12] for e in self.entries if e is not None})
        return f"RemoteKV(rows={len(self.entries)}, width={self.width}, states={named})"

    def length(self) -> int:
        return self.width

    def select_rows(self, rows: torch.Tensor) -> RemoteKV:
        return RemoteKV(tuple(self.entries[int(r)] for r in rows.tolist()), self.width)

    def crop(self, columns: int) -> RemoteKV | None:
        return RemoteKV(self.entries, min(columns, self.width)) if columns > 0 else None

    def keep(self, mask: torch.Tensor) -> RemoteKV:
        # the server keeps a row's first cached tokens (the state's mask says how many): nothing to cut here
        return self

    def narrow(self, rows: int, lead: int) -> RemoteKV:
        return RemoteKV(self.entries[:rows], self.width - lead)

    def settle(self) -> RemoteKV:
        return self

    def nbytes(self, seen: set | None = None) -> int:
        return 0  # the bytes are the server's

    @classmethod
    def stack(cls, kvs: list[Any], width: int, reserve: int = 0) -> RemoteKV:
        entries: list[Entry] = []
        for kv in kvs:
            entries.extend(kv.entries if kv is not None else ())
        return cls(tuple(entries), width)

    def save(self) -> dict:
        """The handle as JSON (a saved remote state keeps its handle: ``RemoteModel.save_kv``)."""
        return {"entries": [list(e) if e is not None else None for e in self.entries], "width": self.width}

    @classmethod
    def restore(cls, meta: dict) -> RemoteKV:
        return cls(tuple((str(e[0]), int(e[1])) if e is not None else None for e in meta["entries"]), int(meta["width"]))
