"""B21s: ``continuum serve model.gguf`` from the command to a ``/health`` that answers 200 (ready to serve).

The process imports torch and FastAPI on its main thread while llama.cpp loads the GGUF and allocates its
context on another (``continuum/serve/cli.py``); the package's roots import nothing heavy until used.
Baseline in the same run: a fresh interpreter that only imports torch (the floor the server's start cannot
go under without leaving torch out). Target: ready in <= 3 s on Gemma 3 270M (issue 51).
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

from .common import Bench, Row, Skip, free_port, log
from .llamacpp_bench import gguf_bench

__all__ = ["STARTUP_SCENARIOS", "ready_seconds"]

ROOT = Path(__file__).resolve().parents[1]


def ready_seconds(gguf: Path, timeout: float = 120.0) -> float:
    """Seconds from starting ``python -m continuum serve GGUF`` to its first 200 on ``/health``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as store:
        port = free_port()
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "continuum", "serve", str(gguf), "--port", str(port), "--store",
                                 store, "--log-level", "warning"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}): {proc.stderr.read().decode()[-1500:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                        return time.perf_counter() - start
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - start > timeout:
                    raise RuntimeError(f"the server was not ready in {timeout:g} s")
                time.sleep(0.01)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


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
    reps = 1 if cfg.smoke else 3
    log(f"B21s: `continuum serve {path.name}` to a ready /health, {reps} starts")
    if not cfg.smoke:
        ready_seconds(path)  # (warm: the first start reads the file from disk, as no later start does)
    ready = [ready_seconds(path) for _ in range(reps)]
    floor = [_torch_import_seconds() for _ in range(reps)]
    r, f = statistics.median(ready), statistics.median(floor)
    return [Row("B21s", f"serve {name}: command to ready (/health 200), seconds", "a fresh interpreter importing "
                f"torch only: {f:.2f} s", round(r, 2), "<=", 3.0, "s", base_s=f, cont_s=r, reps=reps,
                notes=[f"starts: {', '.join(f'{x:.2f}' for x in ready)} s; torch import alone: "
                       f"{', '.join(f'{x:.2f}' for x in floor)} s"])]


STARTUP_SCENARIOS = {"B21S": b21s}
