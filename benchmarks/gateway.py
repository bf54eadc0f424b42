"""SMG (``pip install smg``: the gateway that grew out of SGLang's router) in front of ``continuum serve``
replicas, as a process on loopback: the gateway tests and B28 start it the way ``docs/scaleout.md`` tells
an operator to. Nothing here routes a request: SMG does.

SMG finds a worker's kind through ``GET /version`` and its model through ``GET /v1/models`` (both answer
without a key on ``continuum serve``), and forwards each client's ``Authorization`` header, so the
replicas' own ``--api-key`` checks and per-key isolation hold behind it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from .serving import LoopbackProcess, free_ports

__all__ = ["Gateway", "smg_binary"]


def smg_binary() -> str | None:
    """The ``smg`` command installed beside this interpreter (the ``cluster-test`` extra), or None."""
    return shutil.which("smg")


class Gateway(LoopbackProcess):
    """``smg launch`` over ``workers`` (base URLs) with ``policy``; ``url`` is its ``/v1`` base.

    ``round_robin`` sends each request to the next replica; ``consistent_hashing`` sends every request
    carrying the same ``X-SMG-Routing-Key`` header to the same replica (a conversation's turns land where
    its state is resident)."""

    def __init__(self, workers: list[str], policy: str = "round_robin", log: Path | None = None,
                 timeout: float = 60.0):
        binary = smg_binary()
        if binary is None:
            raise RuntimeError('the smg gateway is not installed: pip install "continuum[cluster-test]" (or smg)')
        (self.port, metrics_port), self.workers = free_ports(2), workers
        # its own Prometheus port (the default, 29000, is one per machine: two gateways would collide); its health
        # checks read readiness (/ready: the replica's store answers), not liveness (/health: the process serves)
        cmd = [binary, "launch", "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(metrics_port), "--worker-urls", *workers, "--policy", policy,
               "--health-check-endpoint", "/ready", "--log-level", "warn", "--disable-retries",
               "--shutdown-grace-period-secs", "1"]
        self._log = open(log or os.devnull, "ab")  # noqa: SIM115 - the gateway's output, open while it runs
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.log = log
        try:
            self._wait(timeout)
        except RuntimeError:
            self.stop()
            raise

    def _wait(self, timeout: float) -> None:
        """Until every worker is registered, healthy and serving a model (SMG probes them after it listens)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited ({self.proc.returncode}): {self._tail()}")
            try:
                listed = httpx.get(self.base + "/workers", timeout=2).json().get("workers", [])
                if len(listed) == len(self.workers) and all(w.get("is_healthy") and w.get("models") for w in listed):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"smg did not register its {len(self.workers)} workers in {timeout:g} s: {self._tail()}")

    def _tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log is not None and self.log.exists() else "(no log kept)"

    def client(self, key: str, routing_key: str | None = None):
        """An ``openai`` client through the gateway; ``routing_key`` sets ``X-SMG-Routing-Key`` on every call."""
        import openai

        headers = {"X-SMG-Routing-Key": routing_key} if routing_key else None
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=120, default_headers=headers)
