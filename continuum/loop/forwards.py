"""The engine's counters (``Engine.stats()``: forwards, padding, KV bytes, time in the model). A step's forward
requests reach the model through ``model.run_step(requests, counters)``, the backend's own way of running them
(transformers: :mod:`continuum.models.hf.step`, merged groups in slabs), which moves these counters."""

from __future__ import annotations

__all__ = ["new_counters", "report"]


def new_counters() -> dict:
    """The engine's counters, zeroed (``Engine.stats()`` names them)."""
    return {"steps": 0, "busy_s": 0.0, "forward_s": 0.0, "merged_forwards": 0, "requests_merged": 0, "alone": 0,
            "fallbacks": 0, "new_slabs": 0, "joins_copied": 0, "wakeups": 0, "peak_rows": 0, "peak_padding": 1.0,
            "peak_kv_bytes": 0, "_peak_cells": 0, "parked": 0, "resumed": 0, "no_room": 0,
            "peak_running_kv_bytes": 0}


def report(stats: dict, step_times: list[float]) -> dict:
    """The counters as ``Engine.stats()`` reports them, with the derived figures: the 99th percentile of a
    step's time (``p99_step_s``) and the share of the steps' time outside the model's forwards."""
    out = {k: v for k, v in stats.items() if not k.startswith("_")}
    steps = sorted(step_times)
    out["p99_step_s"] = steps[min(len(steps) - 1, int(0.99 * len(steps)))] if steps else 0.0
    out["outside_forward_share"] = 1.0 - out["forward_s"] / out["busy_s"] if out["busy_s"] else 0.0
    out["p99_step_wait_s"] = out["p99_step_s"]  # (the name of earlier releases)
    return out
