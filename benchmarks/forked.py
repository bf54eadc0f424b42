"""``continuum serve`` forked from a process that has imported torch, transformers and the server once.

Most of a transformers server's start is the interpreter's imports (about 8 s of the 9.6 s to /health on 2 cores:
torch 2.6 s, transformers 4.5 s), and the test suite starts some twenty of them: in a profile of the suite under
pytest-xdist those imports were ~430 s of CPU, more than any test module. A forkserver (``multiprocessing``'s:
started once per test process, single-threaded, it has computed nothing, so no OpenMP team or tokenizer pool is
copied) imports them once; each server is then a fork of it running the same ``continuum serve`` entry point with
the same arguments, a real process on its own port whose output goes to its log file.

The suite turns it on (``CONTINUUM_FORKED_SERVERS=1``, tests/conftest.py); benchmarks that time a server's start (B21s)
and the tests of the command itself start ``python -m continuum serve`` as a user does. A ``.gguf`` server is
started that way too: it loads llama.cpp before it imports torch (``continuum serve``'s own order)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["Process", "enabled"]

# what a transformers server imports before it serves (a missing one is skipped by multiprocessing)
PRELOAD = ["torch", "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "continuum", "continuum.models", "continuum.serve.cli", "continuum.serve.app", "fastapi", "uvicorn"]
_CONTEXT: Any = None


def enabled() -> bool:
    return os.environ.get("CONTINUUM_FORKED_SERVERS") == "1"


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        # the servers run one torch thread (OMP_NUM_THREADS=1, as benchmarks/replicas.py starts them): libgomp reads
        # it once, when torch loads, which is in the forkserver
        before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = before
        _CONTEXT = ctx
    return _CONTEXT


def _serve(argv: list[str], log: str, env: dict[str, str], cwd: str) -> None:
    """The forked server: its folder, environment and output (``log``), then ``continuum``'s own entry point."""
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    import atexit

    from continuum.__main__ import main

    code = 1
    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()  # (multiprocessing's child ends with os._exit, which runs none)
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


class Process:
    """What :class:`benchmarks.replicas.Server` uses of a ``subprocess.Popen``, for a forked server."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str], cwd: Path):
        self.args = argv
        self._proc = _context().Process(target=_serve, args=(argv, str(log), env, str(cwd)), daemon=True)
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return None if self._proc.is_alive() else self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._proc.exitcode

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()
