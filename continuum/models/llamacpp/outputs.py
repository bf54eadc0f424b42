"""The arrays a decode copies its logits into, each reused once nothing can read it any more.

A decode copies the logits it asked for out of llama.cpp's buffer (the next decode overwrites that) into a numpy
array, which the step's requests then read: the log-softmax runs in place, and the calls get views of it
(``gather.fill_results``). Writing a fresh array costs its page faults first: at 32 rows of Gemma 3's 262,144
columns (32 MiB), 3.4 ms to copy into a new array against 1.4 ms into one written before (2 cores), about 2% of a
32-row step. So each pool keeps its last few arrays and hands one out again when no reference to it is left
outside this module.

An array's readers are counted by Python itself: every numpy view (a view's ``base`` is the array that owns the
memory), every tensor ``torch.from_numpy`` made of it or of a view (the tensor's storage holds the view) and every
memoryview holds a reference to the owning array. An array is reused only when its reference count equals that of
a probe array held the same way and never handed out, so the comparison does not depend on how a Python version
counts a loop variable or a call's argument.

Example:
    >>> outputs = Outputs()
    >>> a = outputs.take(2, 8)
    >>> b = outputs.take(2, 8)                 # a is still read: another array
    >>> first = id(a.base)
    >>> del a
    >>> id(outputs.take(2, 8).base) == first   # nothing reads a's array any more: it is handed out again
    True
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["Outputs"]

KEEP = 2  # arrays kept per pool (a step's logits may still be read while the next step decodes)
KEEP_BYTES = 64 << 20  # an output larger than this (a prefill asking for every position's logits) is not kept


class Outputs:
    """A pool's reusable logits arrays (see the module docstring); used under the model's lock."""

    def __init__(self) -> None:
        self._held: list[np.ndarray] = [np.empty(1, np.float32)]  # [0]: the probe, never handed out

    def take(self, n: int, vocab: int) -> np.ndarray:
        """A float32 ``(n, vocab)`` array nothing else refers to (its content undefined)."""
        size = n * vocab * 4
        if n == 0 or size > KEEP_BYTES:
            return np.empty((n, vocab), np.float32)
        free = None
        for i, arr in enumerate(self._held):
            count = sys.getrefcount(arr)
            if i == 0:
                idle = count  # (the probe: the references of the list, the loop and the call only)
            elif count == idle:
                if arr.shape[0] >= n and arr.shape[1] == vocab:
                    return arr[:n]  # (a view: it holds the array while the caller reads it)
                free = i
        arr = np.empty((n, vocab), np.float32)
        if free is not None:
            self._held[free] = arr  # (a free array of another shape gives way)
        elif len(self._held) <= KEEP:
            self._held.append(arr)
        return arr[:n]
