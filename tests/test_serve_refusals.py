"""Issue 31: a refusal never drops the client's connection, and an internal error does not either
(a real server process, the official ``openai`` client, one TCP connection)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from test_serve import BAD_CHAT, chat

from serve_support import KEYS

MODEL = "tiny"


# model_dir, server, client, lib: the shared module-scoped fixtures of tests/serve_fixtures.py (via conftest)


REFUSALS = [  # (path, body changes) over a good request of that path; every one is a 4xx
    *(("/chat/completions", change) for change, _ in BAD_CHAT),
    ("/chat/completions", {"response_format": {"type": "json_schema",
                                               "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}}}),
    ("/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}),
    # issue 35: a reference that points to nothing in the tool's own parameters (embedded in the call's envelope);
    # a bad format beside tools in "auto" (the call-or-answer grammar), both refused before anything streams
    ("/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Missing"}}, "$defs": {}}}}], "tool_choice": "auto"}),
    ("/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto", "stream": True,
                           "response_format": {"type": "json_schema",
                                               "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
    ("/responses", {"tools": [{"type": "function", "name": "f"}], "tool_choice": "auto",
                    "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": 5}}}}),
    ("/responses", {"previous_response_id": "resp_unknown"}),
    ("/responses", {"input": [{"type": "image"}]}),
    ("/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": 5}}}}),
    ("/completions", {"prompt": "x " * 3000}),
    ("/completions", {"prompt": "x " * 3000, "echo": True, "logprobs": 1, "stream": True}),
    ("/completions", {"max_tokens": "many"}),
    ("/completions", {"prompt": [1, 10**9]}),
    ("/completions", {"prompt": []}),
]
GOOD = {"/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "temperature": 0},
        "/responses": {"model": MODEL, "input": "x", "max_output_tokens": 2, "temperature": 0, "store": False},
        "/completions": {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0}}


def test_refusals_keep_the_connection(server):
    """Issue 31: every refusal of the sweep, interleaved with good requests, on ONE ``openai`` client
    (max_retries=0): every good request succeeds, every refusal is a 4xx, all on the same TCP connection
    (its local address never changes), and the server logs no traceback."""
    import httpx

    addresses = set()

    def seen(response):
        addresses.add(response.extensions["network_stream"].get_extra_info("client_addr"))

    http = httpx.Client(event_hooks={"response": [seen]}, limits=httpx.Limits(max_connections=1))
    client = openai.OpenAI(base_url=server.url, api_key=KEYS[0], max_retries=0, timeout=60, http_client=http)
    log_before = server.log.read_text()
    for path, change in REFUSALS:
        good = client.post(path, body=GOOD[path], cast_to=httpx.Response)
        assert good.status_code == 200, good.text
        with pytest.raises(openai.APIStatusError) as err:
            client.post(path, body={**GOOD[path], **change}, cast_to=httpx.Response)
        assert 400 <= err.value.status_code < 500 and err.value.body["message"], (path, change, err.value)
    assert chat(client, "still here", max_tokens=2).choices[0].finish_reason in ("stop", "length")
    assert len(addresses) == 1, addresses
    log = server.log.read_text()[len(log_before):]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


def test_internal_error_keeps_the_connection(lib, tmp_path):
    """A real internal error (a route that raises) is a 500 in OpenAI's body, logged with its traceback,
    and the client's next request on the same connection works (uvicorn in a thread, a real socket)."""
    import logging

    import httpx
    import uvicorn

    from benchmarks.serving import free_port
    from continuum.serve.app import ServeConfig, create_app

    app = create_app(lib, ServeConfig(served_model_name=MODEL, store=tmp_path / "store"))

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("continuum.serve").addHandler(handler)
    thread.start()
    try:
        while not srv.started:
            time.sleep(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
            r = http.get("/boom")
            first = r.extensions["network_stream"].get_extra_info("client_addr")
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            r = http.get("/health")
            assert r.status_code == 200 and r.extensions["network_stream"].get_extra_info("client_addr") == first
    finally:
        srv.should_exit = True
        thread.join(10)
        logging.getLogger("continuum.serve").removeHandler(handler)
    assert any(rec.exc_info and isinstance(rec.exc_info[1], RuntimeError) for rec in records)
