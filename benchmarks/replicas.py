"""``continuum serve`` as a process on loopback, the way the server tests, B21 and B28 start it: a free port,
this checkout's ``continuum`` (``PYTHONPATH``), one torch thread, the output in a log file; restart on the
same port and store, ``kill -9``, and the ``/metrics`` it serves, parsed by prometheus_client's own parser."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from . import forked
from .serving import LoopbackProcess, free_port, wait_healthy

__all__ = ["Server", "metrics", "start_servers"]

ROOT = Path(__file__).resolve().parents[1]


def metrics(base: str) -> dict[str, float]:
    """``base``/metrics as {sample name (with its labels but ``le`` and ``model_name``, e.g. ``x_count{op=load}``):
    value}. (Every sample carries ``model_name``, as vLLM's do; a server serves one model, so it names nothing.)"""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=10).text
    return {(s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()) if k != "model_name")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if "le" not in s.labels}


class Server(LoopbackProcess):
    """``python -m continuum serve MODEL --store STORE ARGS`` as ``name``; ``url`` is its ``/v1`` base.

    ``store``: a folder, or a ``postgresql://`` URL (kept a string: a Path would fold its '//'; then give
    ``log=``). ``key``: the API key :meth:`client` sends by default."""

    def __init__(self, model: str, store: Path | str, *args: str, log: Path | None = None, name: str = "tiny",
                 key: str = "none", timeout: float = 90.0):
        self.model, self.args, self.name, self.key = model, list(args), name, key
        self.store: Path | str = store if isinstance(store, str) and "://" in store else Path(store)
        self.log = log or Path(self.store).with_suffix(".log")
        self.proc: subprocess.Popen | forked.Process | None = None
        self.port = free_port()
        self.start(timeout)

    def start(self, timeout: float = 90.0) -> None:
        """Start (or restart, on the same port and store) the server and wait for ``/health``."""
        cmd = [sys.executable, "-m", "continuum", "serve", self.model, "--port", str(self.port), "--store",
               str(self.store), "--served-model-name", self.name, "--log-level", "warning", *self.args]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        self._log = open(self.log, "ab")  # noqa: SIM115 - the server's output, open while it runs
        if forked.enabled() and not self.model.endswith(".gguf"):  # (the test suite: imports paid once)
            self.proc = forked.Process(cmd[3:], self.log, env, ROOT)
        else:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.proc, self.base, "the server", timeout, output=lambda: self.log.read_text()[-3000:])
        except BaseException:
            self.stop()
            raise

    def health(self) -> dict:
        """``/health``: liveness (the process serves; it never asks the database)."""
        return httpx.get(self.base + "/health", timeout=5).json()

    def ready(self) -> httpx.Response:
        """``/ready``: readiness (503 with a reason while the store does not answer)."""
        return httpx.get(self.base + "/ready", timeout=10)

    def metrics(self) -> dict[str, float]:
        return metrics(self.base)

    def client(self, key: str | None = None):
        import openai

        return openai.OpenAI(base_url=self.url, api_key=key or self.key, max_retries=0, timeout=120)

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()



def start_servers(*makers: Callable[[], Server]) -> list[Server]:
    """``[make() for make in makers]``, each on a thread of its own: a start is mostly one interpreter's imports,
    so two replicas start in about the time of one on 2 cores (replicas on one PostgreSQL store also start at
    once in a deployment: its schema is created under an advisory lock). If one fails, the others are stopped
    and its error is raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(makers)) as pool:
        futures = [pool.submit(make) for make in makers]
    started, error = [], None
    for future in futures:
        try:
            started.append(future.result())
        except BaseException as exc:  # noqa: BLE001 - raised below, once the others are stopped
            error = error or exc
    if error is not None:
        for server in started:
            server.stop()
        raise error
    return started
