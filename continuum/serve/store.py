"""Where responses live: SQLite (WAL) for their JSON and conversations, a state part beside each.

A stored state is a chain of parts (``continuum.state.parts``): a response that continues another
writes only the columns its parent's state does not have (the turn's new tokens and their KV), and
its part names the parent's part, which is referenced, never copied; two branches share their
parent's part. So a turn writes bytes in proportion to its new tokens, not to the conversation.
A part is deleted when no live response's chain needs it (``DELETE``, retention), not before.

Order of writes for one response: the part file (written under a temporary name, then renamed: a
reader never sees half a file), then ONE SQLite transaction with the part's row and the response's
row. Both happen before the response is returned, so after a ``kill -9`` at any moment every returned
response is there with its whole chain, and a response that was in flight is absent (an orphan part
file without a row is removed at the next start). SQLite runs in WAL mode with ``synchronous=NORMAL``:
a committed transaction survives the process being killed (only a power loss could lose it).

States are also kept in memory, least recently used first out, under a byte budget; a state that
is not in memory is loaded from its chain (root first) with continuum's fingerprinted reader, its
KV cache included, so continuing it computes only the new tokens; with ``kv=False`` parts hold
tokens only and the cache is recomputed on load. A backend's own KV (llama.cpp's) has no columns to cut: its parts
hold tokens, and the states in memory are saved whole at a graceful shutdown, beside their parts (sidecars.py).
Retention (:meth:`Store.enforce_retention`, run on a
schedule of its own by serve/retention.py, never inside a save): rows older than ``max_age`` seconds, and
the oldest rows while the parts exceed ``max_bytes``, are deleted; an expired id answers 404 like an
unknown one from the moment it expires.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..state import SequenceState
from ..state.parts import load_part, save_part, shared_columns
from . import sidecars
from .resident import Resident

__all__ = ["Record", "Resident", "Store", "StoreLockedError", "Tally", "part_file"]

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
CREATE TABLE IF NOT EXISTS parts (
    file TEXT PRIMARY KEY,
    parent TEXT,
    bytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_state_file ON responses (state_file);
CREATE INDEX IF NOT EXISTS parts_parent ON parts (parent);
INSERT OR IGNORE INTO parts (file, parent, bytes)
    SELECT state_file, NULL, state_bytes FROM responses WHERE state_file IS NOT NULL;
"""
# (the INSERT adopts the whole-state files of stores written before parts: each is a root; the two last indexes
# are retention's lookups: a part no response names and no part continues, found without scanning every row)

# the parts some live response needs: its own, and its parent's, recursively
_NEEDED = """
WITH RECURSIVE needed(file) AS (
    SELECT state_file FROM responses WHERE state_file IS NOT NULL
    UNION SELECT parts.parent FROM parts JOIN needed ON parts.file = needed.file WHERE parts.parent IS NOT NULL)
"""


def part_file(rid: str) -> str:
    """The name of response ``rid``'s state part (in the parts table, and the file beside the database)."""
    return f"{rid}.safetensors"


class Tally:
    """What a store did, for ``/metrics``: states loaded from it (not resident) and states found resident, and how
    long its loads and saves took (``on_timing(op, seconds)``, which serve/metrics.py sets)."""

    def __init__(self) -> None:
        self.loads = 0
        self.resident = 0
        self.on_timing: Callable[[str, float], None] | None = None

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if self.on_timing is not None:
            self.on_timing(op, time.perf_counter() - start)


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
    """A stored response: its JSON body, the conversation it ends (messages, reply included), its state part."""

    id: str
    owner: str
    created: float
    body: dict
    messages: list
    state_file: str | None


class Store:
    """Responses in ``root``/responses.sqlite3, state parts in ``root``/states/, states in memory under
    ``memory_bytes``; ``kv=False``: parts hold tokens only (``--store-kv none``).

    Thread-safe: one SQLite connection behind a lock (writes are short; generation happens outside).
    """

    def __init__(self, root: Path, model: Any, *, memory_bytes: int, max_age: float | None, max_bytes: int | None,
                 kv: bool = True):
        self.root, self.model, self.kv = Path(root), model, kv
        self.states_dir = self.root / "states"
        self.states_dir.mkdir(parents=True, exist_ok=True)
        self.memory_bytes, self.max_age, self.max_bytes = memory_bytes, max_age, max_bytes
        self._lock = threading.Lock()
        self._lockfile = _lock_store(self.root)  # one server per store: its start removes other files as orphans
        self._db = sqlite3.connect(str(self.root / "responses.sqlite3"), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._memory = Resident(memory_bytes)  # recently used states, by part file
        self.bytes_written = 0  # part bytes written since start (figures: bytes per turn)
        self.tally = Tally()
        self._remove_orphans()

    # ------------------------------------------------------------------ writing
    def put(self, rid: str, owner: str, body: dict, messages: list, state: SequenceState | None,
            parent: str | None = None, base: SequenceState | None = None) -> None:
        """Write the state's part (atomically), then its row and the response's row (one transaction).
        ``parent``: the response ``state`` continues, whose loaded state is ``base``: only the columns
        ``state`` does not share with it are written. Returns once both are durable."""
        with self.tally.timed("save"):
            self._put(rid, owner, body, messages, state, parent, base)

    def _put(self, rid: str, owner: str, body: dict, messages: list, state: SequenceState | None,
             parent: str | None, base: SequenceState | None) -> None:
        state_file, size = None, 0
        # (the parent's part is named by its id; whether it has one is asked once, in the transaction below)
        parent_file = part_file(parent) if state is not None and parent is not None else None
        start = shared_columns(state, base, self.kv) if state is not None and parent_file is not None else 0
        if state is not None:
            state_file = part_file(rid)
            size = self._write_part(rid, state, start)
        row = (rid, owner, float(body.get("created_at", body.get("created", time.time()))), json.dumps(body),
               json.dumps(messages), state_file, size)
        with self._lock:
            if start and self._db.execute("SELECT 1 FROM parts WHERE file = ?", (parent_file,)).fetchone() is None:
                start = -1  # the parent's part was deleted meanwhile (no live response needed it): write a root
            else:
                self._insert(row, parent_file if start else None)
        if start == -1:
            assert state is not None
            size = self._write_part(rid, state, 0)
            with self._lock:
                self._insert(row[:-1] + (size,), None)
        if state is not None and state_file is not None:
            self._remember(state_file, state)
        # (no retention here: it runs on its own schedule, serve/retention.py)

    def _write_part(self, rid: str, state: SequenceState, start: int) -> int:
        final = self.states_dir / part_file(rid)
        save_part(state, final, start, self.kv)  # (atomic: persistence.write moves a whole file onto the path)
        size = final.stat().st_size
        self.bytes_written += size
        return size

    def _insert(self, row: tuple, parent_file: str | None) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            if row[5] is not None:
                self._db.execute("INSERT INTO parts (file, parent, bytes) VALUES (?, ?, ?)", (row[5], parent_file, row[6]))
            self._db.execute("INSERT INTO responses (id, owner, created, body, messages, state_file, state_bytes) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?)", row)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------------ reading
    def get(self, rid: str, owner: str) -> Record | None:
        """The response ``rid`` of ``owner``, or None (unknown, deleted, expired, or another owner's)."""
        with self._lock:
            row = self._db.execute("SELECT id, owner, created, body, messages, state_file FROM responses "
                                   "WHERE id = ? AND owner = ?", (rid, owner)).fetchone()
        if row is None:
            return None
        if self.max_age is not None and row[2] < time.time() - self.max_age:
            return None  # expired: answered as deleted now; the next retention pass deletes it
        return Record(row[0], row[1], row[2], json.loads(row[3]), json.loads(row[4]), row[5])

    def state(self, record: Record) -> SequenceState | None:
        """The record's state: from memory, or loaded from its chain of parts (root first; from the
        nearest ancestor still in memory)."""
        if record.state_file is None:
            return None
        chain: list[str] = []
        base = None
        with self._lock:
            file: str | None = record.state_file
            while file is not None:
                base = self._memory.get(file)
                if base is not None:
                    break
                chain.append(file)
                row = self._db.execute("SELECT parent FROM parts WHERE file = ?", (file,)).fetchone()
                file = row[0] if row is not None else None
        if not chain:
            self.tally.resident += 1
            return base
        whole = sidecars.load(self.states_dir, record.state_file, self.model)  # (saved at the last shutdown)
        if whole is not None:
            self.tally.loads += 1
            self._remember(record.state_file, whole)
            return whole
        try:
            with self.tally.timed("load"):
                for file in reversed(chain):
                    base = load_part(self.states_dir / file, self.model, base)
        except FileNotFoundError:
            return None  # deleted meanwhile: the conversation is re-rendered from its messages instead
        assert base is not None
        self.tally.loads += 1
        self._remember(record.state_file, base)
        return base

    def in_memory(self, rid: str) -> bool:
        with self._lock:
            return part_file(rid) in self._memory

    # ------------------------------------------------------------------ deleting
    def delete(self, rid: str, owner: str) -> bool:
        """Delete ``owner``'s response ``rid``, and its part unless a live response continues it; False when there is none."""
        with self._lock:
            rows = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ? RETURNING state_file",
                                    (rid, owner)).fetchall()
            if not rows:
                return False
            doomed = self._collect_from([file for (file,) in rows])
        self._unlink([file for file, _ in doomed])
        return True

    def enforce_retention(self) -> int:
        """One retention pass: rows past ``max_age`` (a range of the ``created`` index), then the oldest rows while
        the parts exceed ``max_bytes`` (oldest first by that index; never the newest response); then the parts
        only they needed. Returns the responses deleted."""
        doomed: list[tuple[str, int]] = []
        deleted = 0
        with self._lock:
            if self.max_age is not None:
                rows = self._db.execute("DELETE FROM responses WHERE created < ? RETURNING state_file",
                                        (time.time() - self.max_age,)).fetchall()
                deleted += len(rows)
                doomed += self._collect_from([file for (file,) in rows])
            if self.max_bytes is not None:
                total = self._total()
                newest = self._db.execute("SELECT id FROM responses ORDER BY created DESC LIMIT 1").fetchone()
                while total > self.max_bytes and newest is not None:
                    oldest = self._db.execute("SELECT id, state_file FROM responses WHERE id != ? ORDER BY created "
                                              "LIMIT 1", (newest[0],)).fetchone()
                    if oldest is None:
                        break
                    self._db.execute("DELETE FROM responses WHERE id = ?", (oldest[0],))
                    deleted += 1
                    freed = self._collect_from([oldest[1]])
                    total -= sum(size for _, size in freed)
                    doomed += freed
        self._unlink([file for file, _ in doomed])
        return deleted

    def total_bytes(self) -> int:
        """Bytes of all parts on disk (each written once, however many responses share it)."""
        with self._lock:
            return self._total()

    def save_resident(self) -> int:
        """At shutdown: the states in memory whose KV the backend keeps, saved beside their parts (serve/sidecars.py);
        returns how many. Idempotent."""
        if not self.kv:
            return 0  # (--store-kv none: tokens only, by choice)
        with self._lock:
            resident = self._memory.items()
        return sidecars.save_all(self.states_dir, resident)

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._lockfile.close()  # releases the store's lock

    # ------------------------------------------------------------------ internals
    def _total(self) -> int:
        return int(self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM parts").fetchone()[0])

    def _collect(self) -> list[str]:
        """Drop the rows of every part no live response needs, by scanning them all (under the lock; at start only,
        for what a process killed mid-pass left); returns their files to unlink."""
        doomed = [r[0] for r in self._db.execute(_NEEDED + "SELECT file FROM parts WHERE file NOT IN needed").fetchall()]
        for file in doomed:
            self._db.execute("DELETE FROM parts WHERE file = ?", (file,))
            self._memory.drop(file)
        return doomed

    def _collect_from(self, files: list[str | None]) -> list[tuple[str, int]]:
        """Drop the rows of the parts among ``files`` that nothing needs, then of their parents that nothing needs
        any more, up the chains (under the lock), by index: work in proportion to what was deleted. Returns
        (file, bytes) of each, to unlink."""
        doomed: list[tuple[str, int]] = []
        todo = {file for file in files if file is not None}
        while todo:
            file = todo.pop()
            row = self._db.execute("DELETE FROM parts WHERE file = ? AND NOT EXISTS (SELECT 1 FROM responses WHERE "
                                   "state_file = ?) AND NOT EXISTS (SELECT 1 FROM parts WHERE parent = ?) "
                                   "RETURNING parent, bytes", (file, file, file)).fetchone()
            if row is not None:
                doomed.append((file, row[1]))
                self._memory.drop(file)
                if row[0] is not None:
                    todo.add(row[0])
        return doomed

    def _remember(self, file: str, state: SequenceState) -> None:
        with self._lock:
            self._memory.put(file, state)

    def _unlink(self, files: list[str]) -> None:
        for file in files:
            (self.states_dir / file).unlink(missing_ok=True)
            sidecars.path(self.states_dir, file).unlink(missing_ok=True)

    def _remove_orphans(self) -> None:
        """Parts no live response needs, files without a part row (a response in flight when the process
        died) and temporary files."""
        with self._lock:
            doomed = self._collect()
            known = {r[0] for r in self._db.execute("SELECT file FROM parts")}
        self._unlink(doomed)
        for path in self.states_dir.iterdir():
            if path.name not in known and sidecars.part_of(path.name) not in known:
                path.unlink(missing_ok=True)
