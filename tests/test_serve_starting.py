"""``continuum serve model.gguf`` listens before its engine exists (continuum/serve/starting.py).

The ASGI front is driven directly (a build held on an event: every phase observed, no timing luck), then a real
server on a real GGUF: a request sent at the first 200 gets what the same request gets once the engine is up, and
a build that fails stops the process with one line and status 2.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from continuum.serve.starting import Starting


class Driver:
    """Just enough of an ASGI server: lifespan start, then one request at a time, its status and JSON body."""

    def __init__(self, app):
        self.app = app

    async def start(self):
        inbox: asyncio.Queue = asyncio.Queue()
        await inbox.put({"type": "lifespan.startup"})
        sent = []

        async def send(message):
            sent.append(message)

        self.lifespan = asyncio.ensure_future(self.app({"type": "lifespan"}, inbox.get, send))
        while not sent:
            await asyncio.sleep(0)
        assert sent == [{"type": "lifespan.startup.complete"}]

    async def request(self, method: str, path: str) -> tuple[int, dict]:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await self.app({"type": "http", "method": method, "path": path, "headers": [], "query_string": b"",
                        "root_path": "", "scheme": "http", "server": ("127.0.0.1", 80)}, receive, send)
        return sent[0]["status"], json.loads(sent[1]["body"])


def inner_app():
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/echo")
    async def echo():
        return {"served": "inner"}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        return {"status": "ready"}

    return app


def test_phases_loading_starting_then_the_app():
    weights, release = threading.Event(), threading.Event()
    failures = []

    def build():
        release.wait(10)
        return inner_app()

    async def scenario():
        driver = Driver(Starting(build, loaded=weights.is_set, failed=failures.append))
        await driver.start()
        assert await driver.request("GET", "/health") == (503, {"status": "loading"})
        assert await driver.request("GET", "/ready") == (503, {"status": "loading"})
        weights.set()
        assert await driver.request("GET", "/health") == (200, {"status": "starting"})  # alive: requests wait
        assert await driver.request("GET", "/ready") == (503, {"status": "starting"})  # not routed to yet
        assert (await driver.request("GET", "/version"))[1]["server"] == "continuum"
        waiting = asyncio.ensure_future(driver.request("POST", "/v1/echo"))  # waits for the app, is not refused
        await asyncio.sleep(0.05)
        assert not waiting.done()
        release.set()
        assert await asyncio.wait_for(waiting, 10) == (200, {"served": "inner"})
        assert await driver.request("GET", "/health") == (200, {"status": "ok"})
        assert await driver.request("GET", "/ready") == (200, {"status": "ready"})  # the app's own, from now on

    asyncio.run(scenario())
    assert failures == []


def test_a_failed_build_is_reported_once_and_waiting_requests_learn_it():
    failures = []

    def build():
        time.sleep(0.05)
        raise RuntimeError("the database does not answer")

    async def scenario():
        driver = Driver(Starting(build, loaded=lambda: True, failed=failures.append))
        await driver.start()
        status, body = await asyncio.wait_for(driver.request("POST", "/v1/echo"), 10)
        assert status == 503 and "the database does not answer" in body["error"]["message"]
        # after the failure /health no longer says "starting": a balancer stops routing here
        status, _ = await driver.request("GET", "/health")
        assert status == 503
        status, _ = await driver.request("GET", "/ready")
        assert status == 503

    asyncio.run(scenario())
    assert [str(e) for e in failures] == ["the database does not answer"]


# --------------------------------------------------------------------------- a real server on a real GGUF
pytest.importorskip("llama_cpp")

from benchmarks.serving import free_port, free_ports, wait_healthy  # noqa: E402

from llamacpp_support import gguf  # noqa: E402
from serve_support import ROOT  # noqa: E402


def serve(model: str, port: int, store: str) -> list[str]:
    return [sys.executable, "-m", "continuum", "serve", model, "--port", str(port), "--store", store,
            "--log-level", "warning"]


ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_a_request_at_the_first_200_is_answered_as_later(tmp_path):
    port = free_port()
    proc = subprocess.Popen(serve(str(gguf("f32")), port, str(tmp_path / "s")), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        # the first 200, whatever it says ("starting" when the engine is still loading)
        wait_healthy(proc, base, "the server", 120, loaded=False, interval=0.01)
        name = httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"]
        body = {"model": name, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
        first = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        assert httpx.get(base + "/health", timeout=5).json()["status"] == "ok"
        again = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
        assert first.json()["choices"][0]["text"] == again["choices"][0]["text"] != ""
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_build_that_fails_stops_the_server_with_one_line(tmp_path):
    pytest.importorskip("psycopg")
    # a PostgreSQL URL where nothing listens: the store cannot open once the model is loaded, after listening
    pg_port, port = free_ports(2)
    url = f"postgresql://continuum@127.0.0.1:{pg_port}/continuum"
    start = time.monotonic()
    out = subprocess.run(serve(str(gguf("f32")), port, url), cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]  # (after psycopg's own warnings of each refused connection)
    assert last.startswith("continuum serve: ") and "database does not answer" in last, out.stderr
    assert time.monotonic() - start < 60
