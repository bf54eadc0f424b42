"""Where responses live: SQLite (WAL) for their JSON and conversations, a state file beside each.

Order of writes for one response: the state file (written under a temporary name, then renamed:
a reader never sees half a file), then ONE SQLite transaction with the row. Both happen before
the response is returned, so after a ``kill -9`` at any moment every returned response is there,
and a response that was in flight is absent (an orphan state file without a row is removed at
the next start). SQLite runs in WAL mode with ``synchronous=NORMAL``: a committed transaction
survives the process being killed (it is in the OS's page cache; only a power loss could lose it).

States are also kept in memory, least recently used first out, under a byte budget; a state that
is not in memory is loaded from its file with continuum's fingerprinted ``load`` (its KV cache
included, so continuing it computes only the new tokens). Retention: rows older than ``max_age``
seconds, and the oldest rows past ``max_bytes`` of state files, are deleted with their files;
an expired id then answers 404 like an unknown one.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..state import SequenceState

__all__ = ["Record", "Store"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    body TEXT NOT NULL,
    messages TEXT NOT NULL,
    state_file TEXT,
    state_bytes INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""


class StoreLockedError(RuntimeError):
    """Another server process uses this store."""


def _lock_store(root: Path):
    """An exclusive lock on ``root``/lock, held while the store is open (the kernel drops it if the process dies)."""
    handle = open(root / "lock", "a+")  # noqa: SIM115 - held open for the store's lifetime
    try:
        import fcntl

        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # not on POSIX: no lock
        pass
    except OSError:
        handle.close()
        raise StoreLockedError(f"another continuum serve process uses the store {root}: stop it, or start this one with "
                               f"another --store") from None
    return handle


@dataclass(frozen=True)
class Record:
    """A stored response: its JSON body, the conversation it ends (messages, reply included), its state file."""

    id: str
    owner: str
    created: float
    body: dict
    messages: list
    state_file: str | None


class Store:
    """Responses in ``root``/responses.sqlite3, states in ``root``/states/, states in memory under ``memory_bytes``.

    Thread-safe: one SQLite connection behind a lock (writes are short; generation happens outside).
    """

    def __init__(self, root: Path, model: Any, *, memory_bytes: int, max_age: float | None, max_bytes: int | None):
        self.root, self.model = Path(root), model
        self.states_dir = self.root / "states"
        self.states_dir.mkdir(parents=True, exist_ok=True)
        self.memory_bytes, self.max_age, self.max_bytes = memory_bytes, max_age, max_bytes
        self._lock = threading.Lock()
        self._lockfile = _lock_store(self.root)  # one server per store: its start removes other files as orphans
        self._db = sqlite3.connect(str(self.root / "responses.sqlite3"), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._memory: OrderedDict[str, tuple[SequenceState, int]] = OrderedDict()
        self._memory_used = 0
        self._remove_orphans()
        self.enforce_retention()

    # ------------------------------------------------------------------ writing
    def put(self, rid: str, owner: str, body: dict, messages: list, state: SequenceState | None) -> None:
        """Write the state file (atomically), then the row (one transaction). Returns once both are durable."""
        state_file, size = None, 0
        if state is not None:
            state_file = f"{rid}.safetensors"
            final = self.states_dir / state_file
            tmp = self.states_dir / f"{rid}.tmp-{os.getpid()}-{threading.get_ident()}"
            state.save(tmp)
            os.replace(tmp, final)  # atomic: the file is whole or absent
            size = final.stat().st_size
        row = (rid, owner, float(body.get("created_at", body.get("created", time.time()))), json.dumps(body),
               json.dumps(messages), state_file, size)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT INTO responses (id, owner, created, body, messages, state_file, state_bytes) "
                                 "VALUES (?, ?, ?, ?, ?, ?, ?)", row)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        if state is not None:
            self._remember(rid, state, size)
        if self.max_bytes is not None or self.max_age is not None:
            self.enforce_retention()

    # ------------------------------------------------------------------ reading
    def get(self, rid: str, owner: str) -> Record | None:
        """The response ``rid`` of ``owner``, or None (unknown, deleted, expired, or another owner's)."""
        with self._lock:
            row = self._db.execute("SELECT id, owner, created, body, messages, state_file FROM responses "
                                   "WHERE id = ? AND owner = ?", (rid, owner)).fetchone()
        if row is None:
            return None
        if self.max_age is not None and row[2] < time.time() - self.max_age:
            self.enforce_retention()
            return None
        return Record(row[0], row[1], row[2], json.loads(row[3]), json.loads(row[4]), row[5])

    def state(self, record: Record) -> SequenceState | None:
        """The record's state: from memory, or loaded from its file (KV cache included)."""
        if record.state_file is None:
            return None
        with self._lock:
            hit = self._memory.get(record.id)
            if hit is not None:
                self._memory.move_to_end(record.id)
                return hit[0]
        path = self.states_dir / record.state_file
        try:
            state = SequenceState.load(path, self.model)
        except FileNotFoundError:
            return None  # deleted meanwhile: the conversation is re-rendered from its messages instead
        self._remember(record.id, state, path.stat().st_size if path.exists() else 0)
        return state

    def in_memory(self, rid: str) -> bool:
        with self._lock:
            return rid in self._memory

    # ------------------------------------------------------------------ deleting
    def delete(self, rid: str, owner: str) -> bool:
        """Delete ``owner``'s response ``rid`` and its state file; False when there is none."""
        with self._lock:
            row = self._db.execute("SELECT state_file FROM responses WHERE id = ? AND owner = ?", (rid, owner)).fetchone()
            if row is None:
                return False
            self._db.execute("DELETE FROM responses WHERE id = ?", (rid,))
            self._forget(rid)
        self._unlink(row[0])
        return True

    def enforce_retention(self) -> None:
        """Delete rows past ``max_age``, then the oldest rows while the state files exceed ``max_bytes``."""
        doomed: list[tuple[str, str | None]] = []
        with self._lock:
            if self.max_age is not None:
                cutoff = time.time() - self.max_age
                doomed += self._db.execute("SELECT id, state_file FROM responses WHERE created < ?", (cutoff,)).fetchall()
                self._db.execute("DELETE FROM responses WHERE created < ?", (cutoff,))
            if self.max_bytes is not None:
                total = self._db.execute("SELECT COALESCE(SUM(state_bytes), 0) FROM responses").fetchone()[0]
                if total > self.max_bytes:
                    for rid, sf, size in self._db.execute(
                            "SELECT id, state_file, state_bytes FROM responses ORDER BY created").fetchall():
                        if total <= self.max_bytes:
                            break
                        self._db.execute("DELETE FROM responses WHERE id = ?", (rid,))
                        doomed.append((rid, sf))
                        total -= size
            for rid, _ in doomed:
                self._forget(rid)
        for _, sf in doomed:
            self._unlink(sf)

    def total_bytes(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COALESCE(SUM(state_bytes), 0) FROM responses").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._lockfile.close()  # releases the store's lock

    # ------------------------------------------------------------------ internals
    def _remember(self, rid: str, state: SequenceState, size: int) -> None:
        if size > self.memory_bytes:
            return
        with self._lock:
            self._forget(rid)
            self._memory[rid] = (state, size)
            self._memory_used += size
            while self._memory_used > self.memory_bytes and self._memory:
                _, (_, freed) = self._memory.popitem(last=False)
                self._memory_used -= freed

    def _forget(self, rid: str) -> None:
        old = self._memory.pop(rid, None)
        if old is not None:
            self._memory_used -= old[1]

    def _unlink(self, state_file: str | None) -> None:
        if state_file:
            try:
                (self.states_dir / state_file).unlink()
            except FileNotFoundError:
                pass

    def _remove_orphans(self) -> None:
        """State files without a row (a response that was in flight when the process died) and temporary files."""
        with self._lock:
            known = {r[0] for r in self._db.execute("SELECT state_file FROM responses WHERE state_file IS NOT NULL")}
        for path in self.states_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)
