"""Load (issue 31): 64 concurrent clients x 4 turns through ``/v1/responses`` (stateful), mixing free text,
strict JSON and tool calls: nothing lost, every reply equal to the same conversation run alone (greedy);
then ``kill -9`` in the middle of the same load and a restart: every response that was returned is
readable and continues exactly, and the store holds exactly the parts the live responses need. Figures
(p50/p99 time to first token, aggregate tokens/s) are printed (``-s``) for docs/serve.md."""

from __future__ import annotations

import statistics
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from test_serve import CARD, CLOCK
from test_serve_store import _needed_parts

from serve_support import Server, shared_model_dir

CLIENTS, TURNS = 64, 4
TOOL = {"type": "function", "name": "get_time", "description": "The time", "parameters": CLOCK}


def _request(i: int, t: int) -> dict:
    """Client i's turn t: free text, strict JSON, or (last turn of every third client) a tool call."""
    kw: dict = {"input": f"Client {i} turn {t}: tell me something", "max_output_tokens": 6, "temperature": 0}
    if (i + t) % 3 == 1:
        kw.update(text={"format": {"type": "json_schema", "name": "card", "schema": CARD, "strict": True}},
                  max_output_tokens=60)
    elif t == TURNS - 1 and i % 3 == 0:
        kw.update(tools=[TOOL], tool_choice="required", max_output_tokens=60)
    return kw


def _turn(client, i: int, t: int, prev: str | None) -> dict:
    t0, ttft, final = time.perf_counter(), None, None
    for ev in client.responses.create(model="tiny", previous_response_id=prev, stream=True, **_request(i, t)):
        if ttft is None and ev.type in ("response.output_text.delta", "response.output_item.added"):
            ttft = time.perf_counter() - t0
        if ev.type == "response.completed":
            final = ev.response
    assert final is not None
    out = [(o.type, o.arguments if o.type == "function_call" else o.content[0].text) for o in final.output]
    return {"id": final.id, "out": out, "ttft": ttft or time.perf_counter() - t0, "tokens": final.usage.output_tokens}


def _conversation(client, i: int, done: list | None = None) -> list[dict]:
    prev, turns = None, []
    for t in range(TURNS):
        r = _turn(client, i, t, prev)
        turns.append(r)
        if done is not None:
            done.append((i, t, r))
        prev = r["id"]
    return turns


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(shared_model_dir(tmp_path_factory), tmp_path_factory.mktemp("load") / "store")
    yield s
    s.stop()


@pytest.mark.slow
def test_load_then_kill9(server):
    client = server.client()
    # the 64 clients (one per thread, used by both loads) are made while the reference runs: making one costs tens of
    # ms of this process's time (an httpx client and its SSL context), which 64 threads used to spend inside each load
    clients: list = []
    maker = threading.Thread(target=lambda: clients.extend(server.client() for _ in range(CLIENTS)))
    maker.start()
    reference = [_conversation(client, i) for i in range(CLIENTS)]  # each conversation alone, one after the other
    maker.join()
    results: dict[int, list] = {}
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _conversation(clients[i], i)))
               for i in range(CLIENTS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    wall = time.perf_counter() - t0
    assert len(results) == CLIENTS  # nothing lost
    for i in range(CLIENTS):
        assert [r["out"] for r in results[i]] == [r["out"] for r in reference[i]], i
    ttfts = sorted(r["ttft"] for run in results.values() for r in run)
    tokens = sum(r["tokens"] for run in results.values() for r in run)
    p99 = ttfts[int(0.99 * (len(ttfts) - 1))]
    print(f"\n{CLIENTS} clients x {TURNS} turns: TTFT p50 {statistics.median(ttfts) * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms; "
          f"{tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tokens/s")

    # the same load again, killed in the middle
    done: list = []
    errors: list = []

    def run(i):
        try:
            _conversation(clients[i], i, done)
        except (openai.APIConnectionError, openai.APIStatusError) as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 300
    while len(done) < CLIENTS * TURNS // 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    server.kill9()
    returned = list(done)
    for th in threads:
        th.join(60)
    assert CLIENTS * TURNS // 2 <= len(returned) < CLIENTS * TURNS and errors
    server.start()
    client = server.client()
    for _, _, r in returned:  # readable as returned
        got = client.responses.retrieve(r["id"])
        assert [(o.type, o.arguments if o.type == "function_call" else o.content[0].text) for o in got.output] == r["out"]
    for i, t, r in returned[:: max(1, len(returned) // 24)]:  # continuing equals the uninterrupted conversation
        if t + 1 < TURNS:
            assert _turn(client, i, t + 1, r["id"])["out"] == reference[i][t + 1]["out"], (i, t)
    assert _needed_parts(server.store) == {p.name for p in (server.store / "states").iterdir()}
    print(f"kill -9 after {len(returned)} of {CLIENTS * TURNS} responses returned: all readable, continued exactly")
