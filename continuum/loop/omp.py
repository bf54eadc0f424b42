"""One OpenMP team computes: a thread that never drives the engine runs its own tensor operations on one thread.

On a CPU, torch (and llama.cpp) run each operation on an OpenMP team of the calling thread, made the first time that
thread runs a parallel region and kept while it lives. libgomp counts the threads of every live team; once they
outnumber the cores it stops spinning between parallel regions, so every operation of every team wakes its threads
through the kernel. The engine's steps run on one thread (the caller's, the run_batch host or the engine's own),
but the threads that hand their calls over (:func:`~continuum.loop.driving.never_drive`: acall's workers, a
server's request threads, run_batch's call threads) still stack and split joint calls' rows, copies of every row's
cache big enough to run in parallel: each made a team of its own. Measured (stories260K, 2 torch threads, 128 acalls
of 32 tokens under ``asyncio.gather``): 376 ms with those teams, against 243 ms for the same calls in ``run_batch``
and 192 / 187 ms for both at one torch thread.

:func:`one_thread` sets the calling thread's own OpenMP thread count (``omp_set_num_threads`` acts on the calling
thread only) to 1, through the OpenMP runtime already loaded in the process (torch's), after torch has initialised
this thread's setting (it would overwrite it at its first operation otherwise). Where no runtime can be found (not
Linux, or torch built without OpenMP) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

__all__ = ["one_thread", "release_team"]

_RUNTIMES = ("libgomp", "libiomp5", "libomp")
_local = threading.local()


@functools.cache
def _runtime() -> tuple[str, ctypes.CDLL] | None:
    """The OpenMP runtime loaded in this process (torch's) and its name, or None: never loads one of its own (a second
    runtime in one process is what OpenMP warns against)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return None
    # (torch's own copy first: where another library brought a second copy under another path, torch uses its own)
    ordered = sorted(paths, key=lambda p: ("/torch/lib/" not in p, p))
    for name in _RUNTIMES:
        for path in ordered:
            if path.rsplit("/", 1)[-1].startswith(name + "."):
                try:
                    lib = ctypes.CDLL(path)
                    lib.omp_set_num_threads.argtypes, lib.omp_set_num_threads.restype = [ctypes.c_int], None
                except (OSError, AttributeError):
                    continue
                return name, lib
    return None


def one_thread() -> None:
    """This thread's tensor operations run on one thread, no OpenMP team of its own (once per thread)."""
    if getattr(_local, "done", False):
        return
    _local.done = True
    import torch

    if torch.get_num_threads() <= 1:  # (also torch's own initialisation of this thread's setting: before ours)
        return
    runtime = _runtime()
    if runtime is not None:
        runtime[1].omp_set_num_threads(1)


def release_team() -> None:
    """Free the calling thread's OpenMP team, if it has one (libgomp's ``omp_pause_resource_all``, which frees the
    calling thread's pool only): called by a thread that is about to wait while another computes (the event loop's,
    when it hands acalls over), so that the computing thread's team is the only one alive. Its next parallel operation,
    if any, makes a new one. Other runtimes pause every thread's: nothing is done there."""
    runtime = _runtime()
    if runtime is not None and runtime[0] == "libgomp":
        pause = getattr(runtime[1], "omp_pause_resource_all", None)
        if pause is not None:
            pause(1)  # (omp_pause_soft)
