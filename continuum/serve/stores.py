"""Which store a server runs: a folder (:class:`~continuum.serve.store.Store`, SQLite + state files) or a
``postgresql://`` URL (:class:`~continuum.serve.pgstore.PgStore`, shared by replicas). The routes and
``ServedModel`` see only the methods both have."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .store import Store

__all__ = ["open_store"]


def open_store(location: Path | str, model: Any, *, memory_bytes: int, max_age: float | None, max_bytes: int | None,
               kv: bool = True) -> Any:
    """The store at ``location``: a ``postgresql://`` URL (:class:`~continuum.serve.pgstore.PgStore`, shared by
    replicas) or a folder (:class:`Store`); both have the same methods."""
    if isinstance(location, str) and location.startswith(("postgresql://", "postgres://")):
        from .pgstore import PgStore  # (psycopg only where a URL asks for it)

        return PgStore(location, model, memory_bytes=memory_bytes, max_age=max_age, max_bytes=max_bytes, kv=kv)
    return Store(Path(location), model, memory_bytes=memory_bytes, max_age=max_age, max_bytes=max_bytes, kv=kv)
