"""The server's store, keys and lifecycle: API keys and per-key ownership, ``kill -9`` then a restart on
the same store (nothing returned is lost; continuing equals the uninterrupted run; the in-flight
response is absent), a client that disconnects mid-stream, and retention."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from serve_support import KEYS

MODEL = "tiny"


# model_dir, server: the shared fixtures of tests/serve_fixtures.py (states are loaded from the store at every continuation)


def test_api_keys_and_ownership(server):
    import httpx

    alice, bob = server.client(KEYS[0]), server.client(KEYS[1])
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()
    r = httpx.post(server.url + "/responses", json={"model": MODEL, "input": "x"})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    mine = alice.responses.create(model=MODEL, input="Secret plans", max_output_tokens=4, temperature=0)
    assert len(mine.id) >= len("resp_") + 32  # >= 128 random bits
    assert alice.responses.retrieve(mine.id).id == mine.id
    for attempt in (lambda: bob.responses.retrieve(mine.id), lambda: bob.responses.delete(mine.id),
                    lambda: bob.responses.create(model=MODEL, input="x", previous_response_id=mine.id, max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError) as err:  # the same answer as an unknown id
            attempt()
        assert "No response found" in err.value.body["message"]
    assert alice.responses.retrieve(mine.id).output_text == mine.output_text  # bob's attempts changed nothing


def _chain(client, turns, prev=None):
    out = []
    for t in turns:
        r = client.responses.create(model=MODEL, input=t, previous_response_id=prev, max_output_tokens=6, temperature=0)
        out.append(r)
        prev = r.id
    return out


def test_disconnect_mid_stream_stops_generation(server):
    import httpx

    body = {"model": MODEL, "input": "Talk for a long time", "max_output_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/responses", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"},
                      timeout=60) as r:
        deltas, rid = 0, None
        for line in r.iter_lines():
            if rid is None and line.startswith("data: "):
                rid = json.loads(line[6:])["response"]["id"]
            deltas += line.startswith("event: response.output_text.delta")
            if deltas == 3:
                assert server.health()["generating"] == 1
                break  # leaving the loop closes the connection
    deadline = time.monotonic() + 10  # 1500 tokens take longer than this
    while server.health()["generating"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health()["generating"] == 0
    with pytest.raises(openai.NotFoundError):  # stopped, so never stored
        server.client(KEYS[0]).responses.retrieve(rid)


def test_responses_write_their_new_tokens_only(server, model_dir, tmp_path):
    """Issue 31: through the server, each continued response's part names its parent's part and holds its
    new columns only; on a ``--store-kv none`` server (tokens only, the cache recomputed on load) the same
    conversation gives the same replies from smaller parts."""
    from serve_support import Server

    turns = ["Hello there " * 20, "Tell me more", "And then?"]
    full = _chain(server.client(KEYS[0]), turns)
    with sqlite3.connect(server.store / "responses.sqlite3") as db:
        rows = [db.execute("SELECT p.file, p.parent, p.bytes FROM responses r JOIN parts p ON p.file = r.state_file "
                           "WHERE r.id = ?", (r.id,)).fetchone() for r in full]
    assert rows[0][1] is None and rows[1][1] == rows[0][0] and rows[2][1] == rows[1][0]
    assert rows[1][2] < rows[0][2] / 2 and rows[2][2] < rows[0][2] / 2
    light = Server(model_dir, tmp_path / "store", "--store-kv", "none", "--state-memory", "0")
    try:
        again = _chain(light.client(), turns)
        assert [r.output_text for r in again] == [r.output_text for r in full]
        with sqlite3.connect(light.store / "responses.sqlite3") as db:
            light_bytes = [db.execute("SELECT state_bytes FROM responses WHERE id = ?", (r.id,)).fetchone()[0] for r in again]
        assert all(a < b / 4 for a, b in zip(light_bytes, (r[2] for r in rows)))
    finally:
        light.stop()


@pytest.mark.slow
def test_kill9_and_restart_loses_nothing(server, model_dir, tmp_path):
    import httpx

    alice = server.client(KEYS[0])
    turns = ["Hello there", "Tell me more", "And then?"]
    full = _chain(alice, turns)  # the uninterrupted run
    done = _chain(alice, turns[:2])
    # a response in flight when the process dies: absent afterwards, never half-written
    body = {"model": MODEL, "input": "Long story", "max_output_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/responses", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"},
                      timeout=60) as r:
        inflight = None
        for line in r.iter_lines():
            if line.startswith("data: ") and inflight is None:
                inflight = json.loads(line[6:])["response"]["id"]
            if "output_text.delta" in line:
                break
        server.kill9()
    server.start()
    alice = server.client(KEYS[0])
    for r in done:
        assert alice.responses.retrieve(r.id).output_text == r.output_text
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(inflight)
    # every part on disk is a live response's or in a live response's chain, and each has its file (no orphan,
    # no temp file); the store's bytes are the sum of those parts
    assert _needed_parts(server.store) == {p.name for p in (server.store / "states").iterdir()}
    again = alice.responses.create(model=MODEL, input=turns[2], previous_response_id=done[1].id, max_output_tokens=6,
                                   temperature=0)
    assert again.output_text == full[2].output_text  # continuing after the restart equals the uninterrupted run
    assert again.usage.input_tokens_details.cached_tokens == full[2].usage.input_tokens_details.cached_tokens > 0


def _needed_parts(store: Path) -> set[str]:
    """The parts the live responses need (theirs and their chains'), checked against the parts table and the bytes."""
    with sqlite3.connect(store / "responses.sqlite3") as db:
        parent = dict(db.execute("SELECT file, parent FROM parts").fetchall())
        sizes = dict(db.execute("SELECT file, bytes FROM parts").fetchall())
        needed = set()
        for (file,) in db.execute("SELECT state_file FROM responses WHERE state_file IS NOT NULL"):
            while file is not None and file not in needed:
                needed.add(file)
                file = parent[file]
    assert needed == set(parent)  # no part that nobody needs
    assert sum(sizes.values()) == sum((store / "states" / f).stat().st_size for f in needed)
    return needed


def _equal_states(a, b, kv: bool = True) -> None:
    import torch

    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.attention_masks, b.attention_masks)
    assert torch.equal(a.token_logprobs.nan_to_num(7.0), b.token_logprobs.nan_to_num(7.0))
    assert torch.equal(a.weights, b.weights) and a._last == b._last
    if kv:
        ka, kb = a._kv.tensors(), b._kv.tensors()
        assert len(ka) == len(kb) and all(torch.equal(x, y) for la, lb in zip(ka, kb) for x, y in zip(la, lb))


@pytest.mark.parametrize("kv", [True, False])
def test_store_chains_of_parts(tmp_path, llama_model, kv):
    """Issue 31: a continued state writes only its new columns (its parent's part referenced, a branch sharing
    it); a restart reads the chain back bit for bit (with ``kv=False``: the tokens, the cache recomputed) and
    continuing it equals continuing the original; a part goes only when no live response needs it."""
    from continuum import generate, samplers
    from continuum.generate import continuous
    from continuum.serve.store import Store

    gen = continuous(generate.text(llama_model, samplers.greedy()))
    s1 = gen("Once upon a time " * 8, max_tokens=6)
    s2 = gen(s1 + " and then", max_tokens=6)
    s3 = gen(s1 + " but", max_tokens=6)  # a branch of s1
    store = Store(tmp_path, llama_model, memory_bytes=0, max_age=None, max_bytes=None, kv=kv)
    store.put("r1", "o", {"created_at": 1}, [], s1)
    store.put("r2", "o", {"created_at": 2}, [], s2, parent="r1", base=s1)
    store.put("r3", "o", {"created_at": 3}, [], s3, parent="r1", base=s1)
    whole = tmp_path / "whole.safetensors"
    s2.save(whole)
    sizes = {f.name: f.stat().st_size for f in (tmp_path / "states").iterdir()}
    assert sizes["r2.safetensors"] < sizes["r1.safetensors"] < whole.stat().st_size  # the new columns only
    if kv:
        assert sizes["r2.safetensors"] < whole.stat().st_size / 2
    assert store.total_bytes() == sum(sizes.values())
    store.close()
    whole.unlink()
    store = Store(tmp_path, llama_model, memory_bytes=0, max_age=None, max_bytes=None, kv=kv)  # a restart
    for rid, ref in (("r1", s1), ("r2", s2), ("r3", s3)):
        loaded = store.state(store.get(rid, "o"))
        _equal_states(loaded, ref, kv)
        assert int(loaded.cached_tokens.max()) == (int(ref.cached_tokens.max()) if kv else 0)
    more = gen(store.state(store.get("r2", "o")) + " more", max_tokens=6)
    assert more.token_ids.tolist() == gen(s2 + " more", max_tokens=6).token_ids.tolist()
    assert store.delete("r1", "o") and store.get("r1", "o") is None
    assert (tmp_path / "states" / "r1.safetensors").exists()  # still needed by r2 and r3
    _equal_states(store.state(store.get("r3", "o")), s3, kv)
    assert _needed_parts(tmp_path) == {"r1.safetensors", "r2.safetensors", "r3.safetensors"}
    store.delete("r2", "o")
    assert _needed_parts(tmp_path) == {"r1.safetensors", "r3.safetensors"}
    store.delete("r3", "o")
    assert list((tmp_path / "states").iterdir()) == [] and store.total_bytes() == 0
    store.close()


def test_store_retention_and_delete(tmp_path, llama_model):
    from continuum import SequenceState
    from continuum.serve.store import Store, StoreLockedError

    state = SequenceState.from_prompts(llama_model, "Once upon a time")
    store = Store(tmp_path, llama_model, memory_bytes=1 << 20, max_age=None, max_bytes=None)
    for i in range(3):
        store.put(f"resp_{i}", "owner", {"id": f"resp_{i}", "created_at": 1000 + i}, [], state)
    size = store.total_bytes() // 3
    store.max_bytes = 2 * size
    assert store.get("resp_0", "owner") is not None  # a save runs no retention (it runs on a schedule of its own)
    assert store.enforce_retention() == 1  # one pass, synchronously: the oldest goes, with its file
    assert store.get("resp_0", "owner") is None and store.get("resp_2", "owner") is not None
    assert sorted(p.name for p in (tmp_path / "states").iterdir()) == ["resp_1.safetensors", "resp_2.safetensors"]
    store.max_age = 60.0  # created in 1970: everything has expired
    assert store.get("resp_2", "owner") is None  # answered as deleted at once
    assert len(list((tmp_path / "states").iterdir())) == 2  # (deleted by the next pass)
    assert store.enforce_retention() == 2
    assert list((tmp_path / "states").iterdir()) == []
    store.max_age = None
    store.put("resp_x", "owner", {"id": "resp_x"}, [{"role": "user", "content": "hi"}], state)
    assert store.get("resp_x", "someone else") is None and not store.delete("resp_x", "someone else")
    rec = store.get("resp_x", "owner")
    assert rec is not None and rec.messages == [{"role": "user", "content": "hi"}]
    assert store.state(rec).token_ids.tolist() == state.token_ids.tolist()
    store.close()
    reopened = Store(tmp_path, llama_model, memory_bytes=0, max_age=None, max_bytes=None)  # a restart
    with pytest.raises(StoreLockedError):  # one server per store
        Store(tmp_path, llama_model, memory_bytes=0, max_age=None, max_bytes=None)
    rec = reopened.get("resp_x", "owner")
    assert rec is not None and reopened.state(rec).token_ids.tolist() == state.token_ids.tolist()
    assert reopened.delete("resp_x", "owner") and list((tmp_path / "states").iterdir()) == []
    reopened.max_bytes = 1  # smaller than any state: the newest response is kept all the same
    reopened.put("resp_y", "owner", {"id": "resp_y", "created_at": 2000}, [], state)
    assert reopened.enforce_retention() == 0
    assert reopened.get("resp_y", "owner") is not None and reopened.state(reopened.get("resp_y", "owner")) is not None


def test_retention_collects_chains_through_indexes(tmp_path, llama_model):
    """A pass deletes what expired and the parts only they needed, up the chains, and keeps the parts a live
    continuation needs; its lookups are the schema's indexes (SQLite's plan says so), not scans of every row."""
    from continuum import generate, samplers
    from continuum.generate import continuous
    from continuum.serve.store import Store

    gen = continuous(generate.text(llama_model, samplers.greedy()))
    root = gen("Once upon a time", max_tokens=3)
    longer = gen(root + " and then", max_tokens=3)
    store = Store(tmp_path, llama_model, memory_bytes=0, max_age=None, max_bytes=None)
    # r1 <- r2 <- r3 (a chain), r1 <- b2 (a branch); then r1 and r2 expire: r3 still needs both parts
    store.put("r1", "o", {"id": "r1", "created_at": 1000}, [], root)
    store.put("r2", "o", {"id": "r2", "created_at": 1001}, [], longer, parent="r1", base=root)
    longest = gen(longer + " more", max_tokens=3)
    store.put("r3", "o", {"id": "r3", "created_at": time.time()}, [], longest, parent="r2", base=longer)
    store.put("b2", "o", {"id": "b2", "created_at": 1002}, [], longer, parent="r1", base=root)
    store.max_age = 3600.0
    assert store.enforce_retention() == 3  # r1, r2, b2
    assert sorted(p.name for p in (tmp_path / "states").iterdir()) == ["r1.safetensors", "r2.safetensors",
                                                                        "r3.safetensors"]
    assert store.state(store.get("r3", "o")).token_ids.tolist() == longest.token_ids.tolist()
    assert store.delete("r3", "o")  # the last one that needed the chain: all of it goes
    assert list((tmp_path / "states").iterdir()) == [] and store.total_bytes() == 0
    db = sqlite3.connect(str(tmp_path / "responses.sqlite3"))
    plans = {sql: [r[-1] for r in db.execute("EXPLAIN QUERY PLAN " + sql, args)] for sql, args in [
        ("DELETE FROM responses WHERE created < ? RETURNING state_file", (0.0,)),
        ("SELECT id, state_file FROM responses WHERE id != ? ORDER BY created LIMIT 1", ("x",)),
        ("DELETE FROM parts WHERE file = ? AND NOT EXISTS (SELECT 1 FROM responses WHERE state_file = ?) AND NOT "
         "EXISTS (SELECT 1 FROM parts WHERE parent = ?) RETURNING parent, bytes", ("f", "f", "f"))]}
    for sql, plan in plans.items():  # every table read is an index's: a SEARCH, or a SCAN in its order (LIMIT 1)
        assert not [step for step in plan if step.startswith("SCAN") and "USING" not in step
                    and "CONSTANT ROW" not in step], (sql, plan)
    used = " ".join(step for plan in plans.values() for step in plan)
    assert all(index in used for index in ("responses_created", "responses_state_file", "parts_parent"))
    db.close()
    store.close()


def test_retention_timer_runs_passes_off_the_request_path_and_stops():
    from continuum.serve.retention import RetentionTimer

    passes, failures = [], [RuntimeError("the database is failing over: postgresql://u:S3cretPW@db/x")]

    def run():
        if failures:
            raise failures.pop()
        passes.append(time.monotonic())

    timer = RetentionTimer(run, interval=0.05)
    deadline = time.monotonic() + 10
    while len(passes) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    timer.stop()
    done = len(passes)
    time.sleep(0.2)
    assert done >= 3 and len(passes) == done  # a failed pass was retried; none ran after stop()
    assert not timer._thread.is_alive()


def test_chat_template_option_in_process(tmp_path):
    """A model without a chat template (stories260K) served with one (``--chat-template``), through the
    app in-process (starlette's TestClient is an httpx client the ``openai`` client accepts)."""
    from starlette.testclient import TestClient

    from continuum import generate, models, samplers
    from continuum.chat import Chat
    from continuum.serve.app import ServeConfig, create_app
    from continuum.serve.cli import parser

    from conftest import fixture_path

    folder = str(fixture_path("models", "stories260K"))
    template_file = fixture_path("chat_templates", "smollm2.jinja")
    args = parser().parse_args([folder, "--chat-template", str(template_file)])
    model = models.transformers(folder)
    assert not getattr(model.tokenizer.hf, "chat_template", None)
    template = Path(args.chat_template).read_text()
    app = create_app(model, ServeConfig(served_model_name="stories", store=tmp_path / "store", template=template))
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        r = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Tell me a story."}],
                                           max_tokens=12, temperature=0)
        first = client.responses.create(model="stories", input="Tell me a story.", max_output_tokens=12, temperature=0)
        again = client.responses.create(model="stories", input="And then?", previous_response_id=first.id,
                                        max_output_tokens=12, temperature=0)
    ref = Chat(model, template=template).user("Tell me a story.").reply(generate.text(model, samplers.greedy()), max_tokens=12)
    assert r.choices[0].message.content == first.output_text == ref.messages[-1]["content"]
    assert again.usage.input_tokens_details.cached_tokens > 0


FIELDS = {
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
                             ["messages", "max_tokens", "temperature", "top_p", "n", "stop", "response_format", "tools",
                              "tool_choice", "logprobs", "top_logprobs", "seed", "stream_options", "max_completion_tokens"]),
    "/v1/responses": ({"model": MODEL, "input": "hi", "max_output_tokens": 0},
                      ["input", "instructions", "previous_response_id", "store", "text", "tools", "tool_choice",
                       "max_output_tokens", "temperature", "top_p", "metadata"]),
    "/v1/completions": ({"model": MODEL, "prompt": "hi", "max_tokens": 0},
                        ["prompt", "max_tokens", "echo", "logprobs", "stop", "n"]),
}


def test_wrong_values_never_500(tmp_path, model_dir):
    """Every field of every endpoint given values of the wrong type or range: a 4xx with OpenAI's error
    body, or a normal reply where the value is acceptable; never a 500 (in-process app, max_tokens 0:
    the accepted requests only prefill)."""
    from starlette.testclient import TestClient

    from continuum import models
    from continuum.serve.app import ServeConfig, create_app

    app = create_app(models.transformers(model_dir), ServeConfig(served_model_name=MODEL, store=tmp_path / "store"))
    values = [-1, "x", True, [], {}, [1], [{}], {"a": 1}, 10**12]  # (None and "" are mostly the defaults: valid, and slow)
    with TestClient(app, raise_server_exceptions=False) as http:
        for path, (base, fields) in FIELDS.items():
            for field in fields:
                for value in values:
                    if value == 10**12 and "max" in field:  # valid: generates up to the context, which only takes long
                        continue
                    r = http.post(path, json={**base, field: value})
                    assert r.status_code < 500, (path, field, value, r.text)
                    if r.status_code >= 400:
                        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            for junk in (b"", b"null", b"[]", b"1", b"{", b'{"model": "tiny"}'):
                r = http.post(path, content=junk, headers={"content-type": "application/json"})
                assert 400 <= r.status_code < 500 and r.json()["error"]["message"]
