"""Cooperative cancellation of decoding loops: how Ctrl-C and a closed async stream stop a call.

A thread that runs a program for :func:`continuum.run_batch` (or an ``acall``/``astream`` worker)
holds a :class:`CancelToken` in a thread-local. The decoding loop calls :func:`check_cancelled`
once per step (and choice scoring once per call): when the token (or a parent token) is cancelled it
raises :class:`Cancelled` *between* two forwards, so no forward is left half-done and the model and
its prefix cache stay usable. A thread without a token (a plain call) pays one thread-local lookup.

The same call also counts the tokens of each step into the token, which is what the progress bar of
``run_batch(progress=True)`` reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["CancelToken", "Cancelled", "check_cancelled", "bound", "swap", "current"]


class Cancelled(BaseException):
    """Raised inside a worker thread whose run was cancelled (Ctrl-C, a closed stream, a cancelled task).

    A ``BaseException`` like ``KeyboardInterrupt``, so a program's own ``except Exception`` does not
    swallow it; ``run_batch`` and the async helpers catch it. Private: users never see it.
    """


class CancelToken:
    """A cancellation flag with an optional parent (a nested ``run_batch`` inherits its caller's)."""

    __slots__ = ("_cancelled", "first", "parent", "tokens")

    def __init__(self, parent: CancelToken | None = None):
        self._cancelled = False
        self.parent = parent
        self.tokens = 0  # tokens generated under this token (approximate: one per live row per step)
        # when the first step with live rows reached its sampling (the prompt computed: its first token is next);
        # time.perf_counter(), for the server's time-to-first-token
        self.first: float | None = None

    def cancel(self) -> None:
        """Ask every loop running under this token (or a child of it) to stop at its next step."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        token: CancelToken | None = self
        while token is not None:
            if token._cancelled:
                return True
            token = token.parent
        return False


_local = threading.local()


def current() -> CancelToken | None:
    """The token of the calling thread, or None."""
    return getattr(_local, "token", None)


@contextmanager
def bound(token: CancelToken) -> Iterator[CancelToken]:
    """Run the body with ``token`` as the calling thread's token (restored after)."""
    previous = swap(token)
    try:
        yield token
    finally:
        swap(previous)


def swap(token: CancelToken | None) -> CancelToken | None:
    """Make ``token`` the calling thread's token; returns the previous one (``bound`` without a generator's
    context manager: run_batch switches into its instances hundreds of times a run)."""
    previous = getattr(_local, "token", None)
    _local.token = token
    return previous


def check_cancelled(tokens: int = 0) -> None:
    """Raise :class:`Cancelled` when the calling thread's run was cancelled; count ``tokens`` generated.

    Called by the decoding loop once per step (``tokens`` = rows still generating) and by choice
    scoring once per call. Cheap where no token is set: one thread-local lookup.
    """
    token = getattr(_local, "token", None)
    if token is not None:
        if tokens and token.first is None:
            token.first = time.perf_counter()
        token.tokens += tokens
        if token.cancelled:
            raise Cancelled()
