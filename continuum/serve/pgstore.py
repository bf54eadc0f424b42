"""The response store in PostgreSQL (``--store postgresql://...``): the same interface as the folder
:class:`~continuum.serve.store.Store`, so routes and ``ServedModel`` do not know which runs.

Responses, their owner, their messages and their state parts live in the database; a part is a
``bytea`` row holding what ``save_part`` writes (the turn's new columns only, naming its parent's
part), so a long conversation's saves stay O(new tokens) as in the folder store. Several replicas may
share one database: responses are immutable and each replica writes only rows it creates (ids are
random), so there are no lost updates; the part row and the response row are one transaction,
committed before the response is returned. A replica's resident states are an LRU cache in front of
the database: a state not resident is loaded from its chain of parts, KV cache included.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..state import SequenceState
from ..state.parts import load_part, part_bytes, shared_columns
from .errors import StoreUnavailable
from .redact import redact
from .store import Record, Resident, Tally, part_file

__all__ = ["PgStore", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1
_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS continuum_schema (version INTEGER NOT NULL)",
    """CREATE TABLE IF NOT EXISTS responses (
        id TEXT PRIMARY KEY, owner TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, body TEXT NOT NULL,
        messages TEXT NOT NULL, state_file TEXT, state_bytes BIGINT NOT NULL DEFAULT 0)""",
    "CREATE INDEX IF NOT EXISTS responses_created ON responses (created)",
    "CREATE TABLE IF NOT EXISTS parts (file TEXT PRIMARY KEY, parent TEXT, bytes BIGINT NOT NULL, data BYTEA NOT NULL)",
    # retention's lookups (a part no response names and no part continues): by index, not by scanning every row.
    # (Indexes only: a store of schema 1 without them is still schema 1; the first start of this version adds them.)
    "CREATE INDEX IF NOT EXISTS responses_state_file ON responses (state_file)",
    "CREATE INDEX IF NOT EXISTS parts_parent ON parts (parent)",
]
# Retention's statements (tests EXPLAIN them). Expired rows: a range of the ``created`` index.
EXPIRED = "DELETE FROM responses WHERE created < %s RETURNING state_file"
# Over the byte budget: the oldest rows whose running total, newest first, passes it (the window reads the
# ``created`` index backwards, no sort); never the newest response (one larger than the budget stays until a newer
# one comes, as a response just returned must be there when its client continues it).
OVER_BUDGET = """DELETE FROM responses WHERE id IN (SELECT id FROM (SELECT id, created, SUM(state_bytes) OVER
    (ORDER BY created DESC) AS total FROM responses) t WHERE total > %s
    AND created < (SELECT max(created) FROM responses)) RETURNING state_file"""
# Among the parts ``%s`` (those of deleted responses, then their parents), those nothing needs any more: no response
# names them (responses_state_file) and no part continues them (parts_parent).
UNNEEDED = """DELETE FROM parts p WHERE p.file = ANY(%s)
    AND NOT EXISTS (SELECT 1 FROM responses r WHERE r.state_file = p.file)
    AND NOT EXISTS (SELECT 1 FROM parts c WHERE c.parent = p.file) RETURNING p.file, p.parent"""


class PgStore:
    """Responses and state parts in the PostgreSQL database at ``url`` (psycopg 3, a connection pool)."""

    def __init__(self, url: str, model: Any, *, memory_bytes: int, max_age: float | None, max_bytes: int | None,
                 kv: bool = True, pool_size: int = 4):
        from psycopg_pool import ConnectionPool

        self.url, self.model, self.kv = url, model, kv
        _check_reachable(url)  # (a database down at start: one line naming it, password masked, at once)
        self.memory_bytes, self.max_age, self.max_bytes = memory_bytes, max_age, max_bytes
        # check: a connection the database dropped (a restart) is replaced when taken, not handed to a request
        self._pool = ConnectionPool(url, min_size=1, max_size=pool_size, open=True, kwargs={"autocommit": True},
                                    check=ConnectionPool.check_connection)
        self._lock = threading.Lock()  # guards the resident states only; the database does its own locking
        self._memory = Resident(memory_bytes)  # recently used states, by part file
        self.bytes_written = 0
        self.tally = Tally()  # states loaded vs resident, load and save times (/metrics)
        self._create_schema()

    def _create_schema(self) -> None:
        with self._conn() as conn, conn.transaction():
            # one replica creates the schema at a time (the others wait on the advisory lock)
            conn.execute("SELECT pg_advisory_xact_lock(727001)")
            for statement in _SCHEMA:
                conn.execute(statement)
            row = conn.execute("SELECT max(version) FROM continuum_schema").fetchone()
            if row is None or row[0] is None:
                conn.execute("INSERT INTO continuum_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
            elif row[0] > SCHEMA_VERSION:
                from .store import StoreLockedError

                raise StoreLockedError(f"the database {redact(self.url)} holds a continuum store of schema version {row[0]}, "
                                       f"newer than this continuum's {SCHEMA_VERSION}: upgrade continuum")

    @contextmanager
    def _conn(self) -> Iterator[Any]:
        """A pooled connection; the database not answering becomes StoreUnavailable (503 + Retry-After)."""
        import psycopg
        from psycopg_pool import PoolTimeout

        try:
            with self._pool.connection(timeout=5) as conn:
                yield conn
        except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout) as exc:  # (a closed connection: Interface)
            raise StoreUnavailable(f"the response store's database does not answer ({type(exc).__name__}): retry "
                                   f"after a few seconds") from exc

    def healthy(self) -> bool:
        """True when the database answers: on a connection of its own, so that a pool busy with requests under
        load does not read as a database down (a gateway would stop routing to a replica that is only busy)."""
        import psycopg

        try:
            with psycopg.connect(self.url, connect_timeout=2, autocommit=True) as conn:
                conn.execute("SELECT 1")
            return True
        except Exception:
            return False

    # ------------------------------------------------------------------ writing
    def put(self, rid: str, owner: str, body: dict, messages: list, state: SequenceState | None,
            parent: str | None = None, base: SequenceState | None = None) -> None:
        """The part (only the columns ``state`` does not share with ``base``, the loaded state of ``parent``)
        and the response, in one transaction; returns once committed."""
        with self.tally.timed("save"):
            self._put(rid, owner, body, messages, state, parent, base)

    def _put(self, rid: str, owner: str, body: dict, messages: list, state: SequenceState | None,
             parent: str | None, base: SequenceState | None) -> None:
        # (the parent's part is named by its id: whether it has one is asked in the transaction below, not before it)
        parent_file = part_file(parent) if state is not None and parent is not None else None
        start = shared_columns(state, base, self.kv) if state is not None and parent_file is not None else 0
        state_file = part_file(rid) if state is not None else None
        created = float(body.get("created_at", body.get("created", time.time())))
        with self._conn() as conn, conn.transaction():
            if start and conn.execute("SELECT 1 FROM parts WHERE file = %s FOR SHARE", (parent_file,)).fetchone() is None:
                start = 0  # the parent's part was deleted meanwhile: write a root
            size = 0
            if state is not None:
                data = part_bytes(state, start, self.kv)
                size = len(data)
                conn.execute("INSERT INTO parts (file, parent, bytes, data) VALUES (%s, %s, %s, %s)",
                             (state_file, parent_file if start else None, size, data))
                self.bytes_written += size
            conn.execute("INSERT INTO responses (id, owner, created, body, messages, state_file, state_bytes) "
                         "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                         (rid, owner, created, json.dumps(body), json.dumps(messages), state_file, size))
        if state is not None and state_file is not None:
            self._remember(state_file, state)
        # (no retention here: it runs on its own schedule, serve/retention.py)

    # ------------------------------------------------------------------ reading
    def get(self, rid: str, owner: str) -> Record | None:
        with self._conn() as conn:
            row = conn.execute("SELECT id, owner, created, body, messages, state_file FROM responses "
                               "WHERE id = %s AND owner = %s", (rid, owner)).fetchone()
        if row is None:
            return None
        if self.max_age is not None and row[2] < time.time() - self.max_age:
            return None  # expired: answered as deleted now; the next retention pass deletes it
        return Record(row[0], row[1], row[2], json.loads(row[3]), json.loads(row[4]), row[5])

    def state(self, record: Record) -> SequenceState | None:
        """The record's state: resident, or loaded from its chain of parts (from the nearest resident ancestor)."""
        if record.state_file is None:
            return None
        chain: list[tuple[str, bytes]] = []
        base, start = None, time.perf_counter()
        file: str | None = record.state_file
        with self._conn() as conn:
            while file is not None:
                with self._lock:
                    base = self._memory.get(file)
                if base is not None:
                    break
                # binary: a bytea arrives as its bytes (the text format would send it hex-encoded, twice the size,
                # and decode it: most of a 77 MB state's load time, measured in B28a)
                row = conn.execute("SELECT parent, data FROM parts WHERE file = %s", (file,), binary=True).fetchone()
                if row is None:
                    return None  # deleted meanwhile: the conversation is re-rendered from its messages
                chain.append((file, bytes(row[1])))
                file = row[0]
        if not chain:
            self.tally.resident += 1
            return base
        for _, data in reversed(chain):
            base = load_part(data, self.model, base)
        assert base is not None
        self.tally.loads += 1
        if self.tally.on_timing is not None:  # (the database's reads and the parts' loading together)
            self.tally.on_timing("load", time.perf_counter() - start)
        self._remember(record.state_file, base)
        return base

    def in_memory(self, rid: str) -> bool:
        with self._lock:
            return part_file(rid) in self._memory

    # ------------------------------------------------------------------ deleting
    def delete(self, rid: str, owner: str) -> bool:
        with self._conn() as conn, conn.transaction():
            rows = conn.execute("DELETE FROM responses WHERE id = %s AND owner = %s RETURNING state_file",
                                (rid, owner)).fetchall()
            if not rows:
                return False
            self._collect(conn, [file for (file,) in rows if file is not None])
        return True

    def enforce_retention(self) -> int:
        """One retention pass, in one transaction: rows past ``max_age``, then the oldest rows past ``max_bytes``,
        then the parts that only they needed. Returns the responses deleted. (Run by serve/retention.py's timer.)"""
        with self._conn() as conn, conn.transaction():
            files: list[str | None] = []
            if self.max_age is not None:
                files += [f for (f,) in conn.execute(EXPIRED, (time.time() - self.max_age,)).fetchall()]
            if self.max_bytes is not None:
                files += [f for (f,) in conn.execute(OVER_BUDGET, (self.max_bytes,)).fetchall()]
            self._collect(conn, [f for f in files if f is not None])
        return len(files)

    def total_bytes(self) -> int:
        with self._conn() as conn:
            row = conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM parts").fetchone()
        return int(row[0]) if row is not None else 0

    def close(self) -> None:
        self._pool.close()

    # ------------------------------------------------------------------ internals
    def _collect(self, conn: Any, files: list[str]) -> None:
        """Delete the parts among ``files`` that nothing needs, then their parents that nothing needs any more,
        up the chains (inside the caller's transaction): work in proportion to what was deleted, by index."""
        gone: list[str] = []
        while files:
            rows = conn.execute(UNNEEDED, (files,)).fetchall()
            gone += [file for file, _ in rows]
            files = sorted({parent for _, parent in rows if parent is not None})
        with self._lock:
            for file in gone:
                self._memory.drop(file)

    def _remember(self, file: str, state: SequenceState) -> None:
        with self._lock:
            self._memory.put(file, state)


def _check_reachable(url: str) -> None:
    """Connect once before the pool does (the pool retries quietly until its timeout): a database that does not
    answer, or a URL libpq refuses, is a :class:`StoreUnavailable` naming the database, its password masked (the
    driver's own message may quote the URL: it is redacted too, and not chained)."""
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=5):
            pass
    except psycopg.Error as exc:
        reason = redact(" ".join(str(exc).split())) or type(exc).__name__  # (libpq's lines: one line)
        raise StoreUnavailable(f"the response store's database does not answer ({redact(url)}): {reason}") from None
