"""``GET /metrics`` in Prometheus text format with the names routers read (vLLM's): requests running and
waiting, end-to-end latency; and ``continuum:`` ones (states loaded from the store). Each app has its
own registry, so several apps in one process (tests) do not collide."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request, Response

__all__ = ["install_metrics"]


def install_metrics(app: FastAPI, ctx: Any) -> None:
    """Add ``/metrics`` and the middleware that times the generation routes."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "Replies decoding now", registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "Replies waiting for room in the KV pool", registry=registry)
    usage = Gauge("vllm:kv_cache_usage_perc", "KV cache in use, 0..1 of the pool (llama.cpp cells) or of kv_budget",
                  registry=registry)
    loads = Gauge("continuum:store_states_loaded", "States loaded from the store (not resident) since start",
                  registry=registry)
    e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from request to full response", registry=registry,
                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, float("inf")))

    def refresh() -> None:
        # read at scrape time: the served model and the store own these numbers
        in_engine = ctx.model.engine.waiting_calls()  # (admitted-not-yet or parked: not decoding)
        running.set(max(0, ctx.served.active - in_engine))
        waiting.set(ctx.served.queue.waiting())  # (and those waiting for a worker thread: what --max-queue bounds)
        usage.set(_kv_usage(ctx.model))
        loads.set(getattr(ctx.store, "loads", 0))

    @app.middleware("http")
    async def time_requests(request: Request, call_next: Any) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        if request.method == "POST" and request.url.path.startswith("/v1/"):
            e2e.observe(time.perf_counter() - start)
        return response

    @app.get("/metrics")
    async def metrics() -> Response:
        refresh()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _kv_usage(model: Any) -> float:
    """The KV pool's cells in use over its size (llama.cpp), or the running calls' KV over ``kv_budget``
    (transformers with a budget); 0 where there is no bound to measure against."""
    measure = getattr(model, "capacity", None)
    cap = measure([]) if measure is not None else None
    if cap is not None and cap.total:
        return min(1.0, cap.used / cap.total)
    budget = getattr(model, "kv_budget", None)
    return min(1.0, model.engine.stats()["running_kv_bytes"] / budget) if budget else 0.0
