"""The FastAPI application: configuration, authentication, body limits, and the routes of each family.

``create_app(model, ServeConfig(...))`` builds the app for a loaded continuum model; ``cli.py``
loads the model and runs it with uvicorn. Routes: ``GET /health`` (liveness: the process serves; it never asks
the database), ``GET /ready`` (readiness: the store answers), ``GET /version``, ``GET /v1/models``,
``POST /v1/chat/completions``, ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``,
``POST /v1/completions``.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..loop.driving import never_drive
from .errors import APIError, Guard, install_handlers
from .queue import ADMITTED, ARRIVAL
from .retention import RetentionTimer
from .served import ServedModel
from .stores import open_store

__all__ = ["Context", "ServeConfig", "create_app"]


def _pooled(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` for anyio's worker pool: the thread never drives the engine (loop/driving.never_drive)."""
    def run() -> Any:
        never_drive()
        return fn()
    return run


@dataclass
class ServeConfig:
    """Server settings (see ``continuum serve --help`` and docs/serve.md)."""

    served_model_name: str
    store: Path | str  # a folder (SQLite + state files) or a postgresql:// URL
    api_keys: list[str] = field(default_factory=list)
    template: str | None = None
    state_memory_bytes: int = 1 << 30
    retention_age: float | None = 30 * 86400.0
    retention_bytes: int | None = 10 << 30
    retention_interval: float | None = 60.0  # seconds between retention passes (None: this server runs none)
    store_kv: bool = True  # False: stored parts hold tokens only, the cache is recomputed on load
    max_body_bytes: int = 8 << 20
    max_string_length: int | None = None
    worker_threads: int = 64
    reasoning: bool = False  # --reasoning: requests think first unless they say otherwise (docs/reasoning.md)
    json_bounds: str | None = "default"  # generate.json's bounds= ("default", "small", None)
    max_queue: int | None = 256  # replies waiting for room in the KV pool before a new one gets 503 (None: no bound)
    speculate: str | None = None  # --speculate lookup: text and JSON replies drafted and verified (continuum.speculate)


class Context:
    """What every route needs: the served model, the store, the settings, and the caller's identity."""

    def __init__(self, model: Any, config: ServeConfig):
        self.model, self.config = model, config
        self.served = ServedModel(model, config.template, max_string_length=config.max_string_length,
                                  reasoning=config.reasoning, bounds=config.json_bounds, max_queue=config.max_queue,
                                  speculate=config.speculate)
        self.store = open_store(config.store, model, memory_bytes=config.state_memory_bytes,
                                max_age=config.retention_age, max_bytes=config.retention_bytes, kv=config.store_kv)
        self.limiter = anyio.CapacityLimiter(config.worker_threads)
        self.probes = anyio.CapacityLimiter(4)  # /ready's database probes: a hung one holds at most these threads
        self.created = int(time.time())
        retains = config.retention_age is not None or config.retention_bytes is not None
        self.retention = RetentionTimer(self.store.enforce_retention, config.retention_interval) \
            if retains and config.retention_interval else None

    def close(self) -> None:
        """At shutdown: no retention pass starts any more (one under way finishes), and the states in the store's
        memory whose KV the backend keeps (llama.cpp) are saved beside their parts, for the next start
        (serve/sidecars.py; idempotent). The store closes with the process (a reply still finishing on a worker thread
        may write to it)."""
        if self.retention is not None:
            self.retention.stop()
        save = getattr(self.store, "save_resident", None)  # (the SQLite store's; not PostgreSQL's)
        if save is not None:
            save()  # (a second close writes nothing: a state already saved keeps its file)

    def owner(self, request: Request) -> str:
        """The caller's identity: a hash of its API key ("" without auth); 401 without a configured key."""
        if not self.config.api_keys:
            return ""
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not key or not any(hmac.compare_digest(key.encode(), k.encode()) for k in self.config.api_keys):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' with a key this "
                                "server was started with (--api-key).", code="invalid_api_key")
        return hashlib.sha256(key.encode()).hexdigest()

    def check_model(self, name: str) -> None:
        if name != self.config.served_model_name:
            raise APIError(404, f"The model {name!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r} (GET /v1/models).", param="model", code="model_not_found")

    async def run(self, fn: Callable[[], Any], reply: bool = False) -> Any:
        """``fn()`` in a worker thread (generation never blocks the event loop). ``reply``: a generation, counted as
        waiting for the model while it waits for a thread (``--max-queue``: 503 past it), and no longer once the
        thread starts it or its client leaves (a cancelled wait frees its place at once)."""
        if not reply:
            return await anyio.to_thread.run_sync(_pooled(fn), limiter=self.limiter)
        self.served.queue.enter()
        started = False

        def work() -> Any:
            nonlocal started
            started = True
            self.served.queue.leave()
            ADMITTED.set(True)  # (this thread's copy of the request's context: it waited, it is not refused now)
            return fn()

        try:
            return await anyio.to_thread.run_sync(_pooled(work), limiter=self.limiter)
        finally:
            if not started:
                self.served.queue.leave()


class _Arrival:
    """Marks when a request arrived (``queue.ARRIVAL``), before anything queues it: its time to first token counts
    from here, as vLLM's does (a reply waiting for a worker thread or for room in the KV pool is waiting)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            ARRIVAL.set(time.perf_counter())  # (this request's task's own context: worker threads copy it)
        return await self.app(scope, receive, send)


class _BodyLimit:
    """Refuse request bodies over ``limit`` bytes (413 with OpenAI's error body), declared or streamed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send):
        import json

        body = json.dumps(APIError(413, f"The request body is larger than this server's limit of {self.limit} bytes "
                                        f"(--max-body-bytes).", code="request_too_large").body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def create_app(model: Any, config: ServeConfig) -> FastAPI:
    """The OpenAI-compatible app serving ``model`` (a continuum model) with ``config``."""
    from . import chat_completions, completions, native, responses

    ctx = Context(model, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        ctx.close()  # (cli.py closes it too: behind serve/starting.py this app gets no lifespan of its own)

    app = FastAPI(title="continuum serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.ctx = ctx
    install_handlers(app)

    @app.get("/health")
    async def health() -> Any:
        # liveness: the process answers, so it can serve. It never asks the database: a database failing over for
        # 20 s must not get every replica restarted by its orchestrator (readiness is /ready's)
        # the model's engine counters (steps, time in forwards, the engine's own share of a step): for operators
        engine = {k: v for k, v in model.engine.stats().items() if isinstance(v, (int, float))}
        return {"status": "ok", "generating": ctx.served.active, "engine": engine}

    @app.get("/ready")
    async def ready() -> Any:
        # readiness: a store that does not answer (the database is down) makes this replica unfit to route to
        reason = await _store_reason(ctx)
        if reason is not None:
            return JSONResponse({"status": "not ready", "reason": reason}, status_code=503,
                                headers={"Retry-After": "5"})
        return {"status": "ready"}

    try:
        from .metrics import install_metrics

        install_metrics(app, ctx)
    except ImportError:  # prometheus_client absent (pip install "continuum[cluster]"): no /metrics
        pass

    @app.get("/version")
    async def version() -> dict:
        # public, as vLLM's: gateways (SMG) probe it to recognise an OpenAI-compatible worker that wants a key
        from .. import __version__

        return {"version": __version__, "server": "continuum"}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        # Without a key the list is public (as llama-server's): a gateway in front (SMG) discovers the model
        # with no key of its own and forwards each client's key, which the generation routes check. A key that
        # is sent is checked here too, so a client with a wrong key learns it at its first call.
        if "authorization" in request.headers:
            ctx.owner(request)
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model", "created": ctx.created,
                                            "owned_by": "continuum"}]}

    chat_completions.register(app, ctx)
    responses.register(app, ctx)
    completions.register(app, ctx)
    native.register(app, ctx)  # continuum's own API: models.remote (docs/remote.md)
    app.add_middleware(_BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(Guard)  # an internal error anywhere is a 500 that keeps the connection
    app.add_middleware(_Arrival)  # outermost: the arrival is taken before anything else runs
    return app


_PROBE_S = 3.0  # /ready answers within this, whatever the database does


async def _store_reason(ctx: Context) -> str | None:
    """Why the store is not ready (None: it answers). The probe (``store.healthy``: a connection of its own, so a
    pool busy under load does not read as a database down) runs on a thread outside the generation threads'
    limiter, as a replica whose threads all generate is busy, not down; it is abandoned after ``_PROBE_S``."""
    healthy = getattr(ctx.store, "healthy", None)
    if healthy is None:  # a folder store: open means ready
        return None
    with anyio.move_on_after(_PROBE_S):
        if await anyio.to_thread.run_sync(healthy, limiter=ctx.probes, abandon_on_cancel=True):
            return None
        return "the response store's database does not answer"
    return f"the response store's database did not answer in {_PROBE_S:g} s"
