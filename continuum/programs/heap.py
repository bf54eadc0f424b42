"""The objects alive when ``run_batch`` starts, kept out of the garbage collector's full collections while it runs.

A full collection (CPython's generation 2) walks every tracked object, and after importing torch and
transformers that is ~386,000 of them: ~180 ms each on a 2-core machine, every thread stopped meanwhile. A
``run_batch`` of many programs allocates enough (states, their rows, the threads' frames) to trigger them:
4 runs of B22b at 128 programs paid 1-2 full collections, 210-465 ms in all; frozen, none. ``gc.freeze()``
moves every object tracked now to a permanent generation that collections skip (vLLM freezes its heap once its
engine has started, for the same pauses); ``gc.unfreeze()`` when the last running ``run_batch`` ends gives them
back, so nothing is kept for good: a cycle that became garbage meanwhile is collected by the next full
collection. Nested and concurrent ``run_batch`` calls freeze once.
``CONTINUUM_GC_FREEZE=0`` turns it off.

Example:
    >>> with frozen_heap():
    ...     pass
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["frozen_heap"]

_lock = threading.Lock()
_depth = 0


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The body runs with the objects alive now out of full collections (see the module)."""
    global _depth
    if os.environ.get("CONTINUUM_GC_FREEZE", "1") == "0":
        yield
        return
    with _lock:
        _depth += 1
        if _depth == 1:
            gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
