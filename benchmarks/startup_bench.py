"""B21s: ``continuum serve model.gguf`` from the command to a ``/health`` that answers 200 (ready to serve).

The server listens before its engine exists (``continuum/serve/starting.py``): llama.cpp loads the GGUF on a
thread, ``/health`` says 200 ``"starting"`` once the weights are in memory, and torch, FastAPI and the engine are
imported after them (on 2 cores, beside llama.cpp's load, both slowed down); a request that arrives meanwhile
waits for the engine. So the row is the time to ready, and its note the time to the first reply (one token,
sent at the first 200), which the import still bounds. Baseline in the same run: a fresh interpreter that only
imports torch. Target: ready in <= 3 s on Gemma 3 270M (issue 51).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .llamacpp_bench import gguf_bench
from .model import Bench
from .results import Row, Skip, log
from .serving import free_port, stop_process, wait_healthy

__all__ = ["STARTUP_SCENARIOS", "ready_seconds"]

ROOT = Path(__file__).resolve().parents[1]


def ready_seconds(gguf: Path, timeout: float = 120.0) -> tuple[float, float]:
    """Seconds from starting ``python -m continuum serve GGUF`` to its first 200 on ``/health``, and to the
    first reply (a one-token completion sent then)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as store:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "continuum", "serve", str(gguf), "--port", str(port), "--store",
                                 store, "--log-level", "warning", "--served-model-name", "m"], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_healthy(proc, base, "the server", timeout, loaded=False, interval=0.01)
            ready = time.perf_counter() - start
            r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 1},
                           timeout=timeout)
            r.raise_for_status()
            return ready, time.perf_counter() - start
        finally:
            stop_process(proc)


def _torch_import_seconds() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def b21s(bench: Bench, cfg) -> list[Row]:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise Skip("the serve extra is not installed (pip install 'continuum[serve]')") from exc
    _, path, name, _ = gguf_bench(cfg)
    reps = 1 if cfg.smoke else 2 if cfg.quick else 3
    log(f"B21s: `continuum serve {path.name}` to a ready /health, {reps} starts")
    if not cfg.smoke:
        ready_seconds(path)  # (warm: the first start reads the file from disk, as no later start does)
    starts = [ready_seconds(path) for _ in range(reps)]
    floor = [_torch_import_seconds() for _ in range(reps)]
    r, first, f = (statistics.median(x) for x in ([a for a, _ in starts], [b for _, b in starts], floor))
    return [Row("B21s", f"serve {name}: command to ready (/health 200), seconds", "a fresh interpreter importing "
                f"torch only: {f:.2f} s", round(r, 2), "<=", 3.0, "s", base_s=f, cont_s=r, reps=reps,
                notes=[f"ready: {', '.join(f'{a:.2f}' for a, _ in starts)} s; first reply (1 token, sent at ready): "
                       f"{', '.join(f'{b:.2f}' for _, b in starts)} s (median {first:.2f}: the engine's imports still "
                       f"bound it); torch import alone: {', '.join(f'{x:.2f}' for x in floor)} s"])]


STARTUP_SCENARIOS = {"B21S": b21s}
