"""``models.remote`` (issue 58) against a real ``continuum serve`` on loopback, real httpx, no mocks: faults.

Errors travel by name (the library's own classes re-raised), handles stay with their API key and a bogus handle is
refused while the state stays usable; kill -9 between two calls, then a restart, continues the state from the store;
a kept-alive connection the server closed is replaced; a repeated call (and a copy sent while the first runs) gets
the stored answer, not a second generation; a proxy from the environment is honoured. Every result is compared
with the local model's (the same checkpoint, transformers in this process). The programs themselves:
``test_remote_programs.py``; the server and the comparison: ``remote_support.py``.
"""

from __future__ import annotations

import time

import pytest

import remote_support
from conftest import FIXTURES
from remote_support import KEYS, MODEL, same
from serve_support import running

pytestmark = pytest.mark.skipif(not (FIXTURES / "models" / "stories260K").exists(), reason="fixtures absent")
server, remote, local = remote_support.server, remote_support.remote, remote_support.local  # the fixtures, by name


def test_errors_travel_by_name_and_handles_stay_with_their_key(server, remote):
    from continuum import continuous, generate, models, samplers, speculate
    from continuum.errors import ContextLengthError, GeneratorArgumentError, RemoteError, RemoteStateError
    from continuum.models.remote.handle import RemoteKV

    text = continuous(generate.text(remote, samplers.greedy()))
    s = text("Once upon a time", max_tokens=4)
    with pytest.raises(ContextLengthError):  # raised by the server, re-raised here as the library's own class
        text("a b " * 400, max_tokens=4)
    with pytest.raises(GeneratorArgumentError, match="speculate.lookup"):  # (a draft model stays local)
        draft = speculate.draft(models.transformers(MODEL))
        continuous(generate.text(remote, samplers.greedy(), speculate=draft))("x", max_tokens=2)

    other = models.remote(server.url, api_key=KEYS[1])  # (the /v1 URL works too)
    with pytest.raises(RemoteStateError, match="for your API key"):
        continuous(generate.text(other, samplers.greedy()))(s, max_tokens=2)  # (same server: the handle is kept)
    bogus = _with_kv(s, RemoteKV((("cs_" + "0" * 48, 0),), s._kv.width))
    with pytest.raises(RemoteStateError, match="no stored state"):
        text(bogus, max_tokens=2)
    # the state stays usable: without its handle it is sent whole, and continues as the original does
    same(text(remote.detach(bogus), max_tokens=3), text(s, max_tokens=3))

    with pytest.raises(RemoteError, match="cannot reach"):
        models.remote("http://127.0.0.1:9", timeout=5)


def _with_kv(state, kv):
    from continuum import SequenceState

    return SequenceState(model=state.model, ids=state._ids, mask=state._mask, logprobs=state._logprobs,
                         weights=state._weights, kv=kv, batch=state.batch, samples=state.samples, last=state._last)


def test_kill_9_between_two_calls_then_restart_continues_the_state(server, remote, local):
    from continuum import continuous, generate, samplers
    from continuum.errors import RemoteError

    text_r = continuous(generate.text(remote, samplers.greedy()))
    text_l = continuous(generate.text(local, samplers.greedy()))
    s = text_r("The little dog", max_tokens=8)
    server.kill9()
    with pytest.raises(RemoteError, match="unchanged"):
        text_r(s + " He", max_tokens=5)
    server.start()
    before = remote.tokens_computed
    after = text_r(s + " He", max_tokens=5)  # the handle returned before the kill is in the store
    s_l = text_l("The little dog", max_tokens=8)
    before_l = local.tokens_computed
    same(after, text_l(s_l + " He", max_tokens=5))
    assert remote.tokens_computed - before == local.tokens_computed - before_l  # continued, not recomputed


def test_a_kept_alive_connection_the_server_closed_is_replaced(local, monkeypatch, tmp_path):
    """Plain calls go out on one kept-alive connection per thread (continuum/models/remote/conn.py), which the server
    closes once idle (here after 1 s: ``--timeout-keep-alive``). A call written into a connection the server closed is
    sent again on a new one (its call id makes the repeat safe), and answers what the local model answers."""
    import select
    import socket

    from benchmarks import replicas
    from continuum import continuous, generate, models, samplers
    from continuum.models.remote import conn

    monkeypatch.setattr(conn, "IDLE_S", 1e9)  # (reused however long it sat idle: the broken-connection path)
    with running(lambda: replicas.Server(MODEL, tmp_path / "store", "--api-key", KEYS[0], "--timeout-keep-alive", "1",
                                         name="stories260K", key=KEYS[0])) as [srv]:
        remote = models.remote(srv.base, api_key=KEYS[0])
        text_r = continuous(generate.text(remote, samplers.greedy()))
        text_l = continuous(generate.text(local, samplers.greedy()))
        s = text_r("The little dog", max_tokens=4)
        sock, deadline = remote.client.conns._local.sock, time.monotonic() + 20
        while time.monotonic() < deadline:  # (until the server has closed it)
            if select.select([sock], [], [], 0.5)[0] and sock.recv(1, socket.MSG_PEEK) == b"":
                break
        else:
            pytest.fail("the server kept an idle connection open for 20 s")
        got = text_r(s + " He", max_tokens=3)
        assert remote.client.conns._local.sock is not sock
        same(got, text_l(text_l("The little dog", max_tokens=4) + " He", max_tokens=3))


def test_a_repeated_call_gets_the_stored_answer_not_a_second_generation(remote):
    from continuum.models.remote.wire import GENERATE

    ids = remote.tokenizer.encode_prompts(["Once upon a time"])[0]
    body = {"generator": {"kind": "text", "arguments": {}, "sampler": {"type": "multinomial", "samples": 4}},
            "rows": [{"ids": ids, "logprobs": [None] * len(ids)}], "batch": 1, "samples": 1, "max_tokens": 8,
            "call": "retry-1"}
    first = remote.client.post(GENERATE, body)
    assert remote.client.post(GENERATE, body) == first  # (unseeded samples: a second generation would differ)
    other = remote.client.post(GENERATE, {**body, "call": "retry-2"})
    assert other["id"] != first["id"]


def test_a_copy_of_a_call_sent_while_it_runs_gets_the_same_answer(remote):
    """The client resends a call when its connection breaks, possibly while the server still runs the first copy:
    the copy waits for that one and gets its answer (unseeded samples: a second generation would differ), and the
    stored state is the one answered (continuing it with the answer's last token as the check is accepted)."""
    import threading

    from continuum.models.remote.wire import GENERATE

    ids = remote.tokenizer.encode_prompts(["Once upon a time"])[0]
    for attempt in range(3):
        body = {"generator": {"kind": "text", "arguments": {}, "sampler": {"type": "multinomial", "samples": 2}},
                "rows": [{"ids": ids, "logprobs": [None] * len(ids)}], "batch": 1, "samples": 1, "max_tokens": 24,
                "call": f"in-flight-{attempt}"}
        answers: list = [None, None]
        go = threading.Barrier(2)

        def send(i: int, go=go, answers=answers, body=body) -> None:
            go.wait()
            answers[i] = remote.client.post(GENERATE, body)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert answers[0] == answers[1] and answers[0] is not None
    row = answers[0]["rows"][0]
    full = ids + row["ids"]
    more = remote.client.post(GENERATE, {
        "generator": {"kind": "text", "arguments": {}, "sampler": {"type": "greedy"}},
        "rows": [{"ids": full[len(full) - 1:], "logprobs": [None], "state": answers[0]["id"], "row": 0,
                  "cached": len(full) - 1, "check": full[-2]}], "batch": 1, "samples": 1, "max_tokens": 2})
    assert more["rows"][0]["ids"]


def test_a_proxy_from_the_environment_is_honoured(remote, local, monkeypatch):
    """Plain calls go out on http.client connections (conn.py), which know nothing of proxies; where HTTP_PROXY
    applies to the server's URL they go through httpx, which honours it (a proxy that does not answer: the call says
    the server cannot be reached, the state stays usable), and NO_PROXY naming the host keeps the direct way."""
    from continuum import continuous, generate, samplers
    from continuum.errors import RemoteError
    from continuum.models.remote.client import Client

    base = remote.client.base
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # (nothing listens on the discard port)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    proxied = Client(base, "k")
    assert proxied.conns is None
    with pytest.raises(RemoteError, match="cannot reach"):
        proxied.get("/health")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    assert Client(base, "k").conns is not None
    text_r = continuous(generate.text(remote, samplers.greedy()))
    s = text_r("The little dog", max_tokens=3)  # (the fixture's client, made before: still direct)
    same(s, continuous(generate.text(local, samplers.greedy()))("The little dog", max_tokens=3))
