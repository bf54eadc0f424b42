"""The server answers while its engine is built: an ASGI app in front of the real one until it exists.

``continuum serve model.gguf`` listens as soon as uvicorn is imported. llama.cpp loads the weights on one
thread (``cli._Preload``) while another imports torch, FastAPI and the engine and builds the app
(``create_app``); neither is needed to say the server is up. Meanwhile:

- ``GET /health`` (liveness) answers 503 (``{"status": "loading"}``, ``Retry-After: 1``) until the weights are
  in memory, then 200 ``{"status": "starting"}``: requests are accepted, and wait for the engine (its first
  import, about as long again on 2 cores: B21s in docs/benchmarks.md) rather than being refused;
- ``GET /ready`` (readiness) answers 503 (``loading``, then ``starting``, ``Retry-After: 1``) until the app is
  built and its store open; from then on the app's own ``/ready`` answers (whether the store answers);
- ``GET /version`` answers (gateways probe it to recognise a worker);
- every other request waits for the app, then is served by it as if it had arrived then.

A build that fails (a database that does not answer, a store another server holds) is reported in one line and
stops the server with status 2, as a failure before listening does; requests that waited get a 503 that says so.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

from .redact import redact

__all__ = ["Starting"]


class Starting:
    """ASGI app: ``build()`` (on a thread from the lifespan's start) makes the real app, which then serves
    everything. ``loaded()`` tells whether the model's weights are in memory (``/health`` 200 from then on);
    ``failed(exc)`` is called on the event loop when ``build()`` raises (it should stop the server); ``stopping(app)``
    on a thread at the lifespan's shutdown, once the server has stopped serving, when the app was built (uvicorn
    raises a SIGTERM again once it has shut down, so nothing after ``Server.run`` runs then)."""

    def __init__(self, build: Callable[[], Any], loaded: Callable[[], bool], failed: Callable[[BaseException], None],
                 stopping: Callable[[Any], None] | None = None):
        self.build, self.loaded, self.failed, self.stopping = build, loaded, failed, stopping
        self.app: Any = None
        self.error: BaseException | None = None
        self._ready: asyncio.Event | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if self.app is not None:  # (built: no more indirection than this attribute read)
            return await self.app(scope, receive, send)
        if scope["type"] == "http" and scope.get("method") == "GET" and self.error is None:
            path = scope.get("path", "")
            if path == "/health":
                if self.loaded():
                    return await _json(send, 200, {"status": "starting"})
                return await _json(send, 503, {"status": "loading"}, retry=True)
            if path == "/ready":  # (a gateway routes here once the store is open, not before: no request waits)
                return await _json(send, 503, {"status": "starting" if self.loaded() else "loading"}, retry=True)
            if path == "/version":
                from .. import __version__

                return await _json(send, 200, {"version": __version__, "server": "continuum"})
        assert self._ready is not None  # (set at the lifespan's start, before uvicorn accepts a connection)
        await self._ready.wait()
        if self.app is None:
            if scope["type"] != "http":
                return
            return await _json(send, 503, {"error": {"message": f"The server failed to start: {redact(self.error)}",
                                                     "type": "server_error", "code": "server_failed_to_start"}})
        return await self.app(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._ready = asyncio.Event()
                loop = asyncio.get_running_loop()
                threading.Thread(target=self._build, args=(loop,), name="continuum-build", daemon=True).start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.app is not None and self.stopping is not None:
                    await asyncio.to_thread(self.stopping, self.app)
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _build(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            app = self.build()
        except BaseException as exc:  # noqa: BLE001 - reported on the loop by failed(); the server stops
            self.error = exc
            loop.call_soon_threadsafe(self._finish, exc)
        else:
            loop.call_soon_threadsafe(self._finish, app)

    def _finish(self, result: Any) -> None:
        # on the event loop: the app (or the error) becomes visible to requests in one place
        assert self._ready is not None
        if isinstance(result, BaseException):
            self.failed(result)
        else:
            self.app = result
        self._ready.set()


async def _json(send, status: int, body: dict, retry: bool = False) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if retry:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
