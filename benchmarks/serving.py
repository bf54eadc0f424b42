"""Helpers for scenarios that start servers and drive them with concurrent clients: a free port, client
threads, waiting for a server's health, stopping its process, and :class:`LoopbackProcess`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .results import log


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a scenario starts)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now: all bound at once before any is released, since the
    kernel may hand the same ephemeral port to two binds in a row (two ``free_port()`` calls gave one gateway
    the same port for HTTP and Prometheus)."""
    import contextlib
    import socket

    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def in_threads(n: int, fn: Callable[[int], Any], timeout: float | None = None,
               tolerate: bool = False) -> tuple[list, float]:
    """``fn(i)`` for i in 0..n-1, each on its own thread (concurrent clients): (results, wall seconds). The first
    error is raised after every thread ended, unless ``tolerate`` (then logged, its result None); a thread still
    running after ``timeout`` seconds is an error."""
    import threading

    out: list = [None] * n
    errors: list = []

    def run(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - reported after the join
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"clients still running after {timeout:g} s")
    if errors and not tolerate:
        raise errors[0]
    for exc in errors:
        log(f"    a client failed: {type(exc).__name__}: {exc}")
    return out, time.perf_counter() - t0


def stop_process(proc: Any, grace: float = 10.0) -> None:
    """Terminate a server process a test or scenario started (SIGTERM, then SIGKILL after ``grace`` seconds)."""
    import subprocess

    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class LoopbackProcess:
    """A process serving HTTP on ``127.0.0.1:port``, its output in a log file (``_log``, open while it runs):
    ``base`` and ``url`` (its ``/v1``), ``stop()``. ``Server`` (benchmarks/replicas.py) and ``Gateway``
    (benchmarks/gateway.py) start theirs."""

    port: int
    proc: Any
    _log: Any

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base + "/v1"

    def stop(self) -> None:
        if self._log.closed:
            return
        stop_process(self.proc)
        self._log.close()


def wait_healthy(proc: Any, url: str, what: str, timeout: float = 300, output: Callable[[], str] | None = None,
                 loaded: bool = True, interval: float = 0.3) -> None:
    """Wait until ``url``/health answers 200 (``loaded``: with its engine loaded, not continuum's ``"starting"``,
    which accepts requests while the engine loads); raise (with the process's last output: ``output()``, default
    its piped stderr) if ``proc`` exits or ``timeout`` seconds pass (then it is killed). The server tests and
    B21s use it too (B21s times the first 200, polling every 10 ms)."""
    import httpx

    def tail() -> str:
        return output() if output is not None else proc.stderr.read().decode()[-2000:] if proc.stderr else ""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{tail()}")
        try:
            r = httpx.get(f"{url}/health", timeout=1)
            if r.status_code == 200 and not (loaded and "starting" in r.text):
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    proc.kill()
    raise RuntimeError(f"{what} did not start in {timeout:g} s" + (f":\n{output()}" if output is not None else ""))
