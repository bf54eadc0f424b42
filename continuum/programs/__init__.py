"""Many calls at once: programs over many inputs, and calls from asyncio (docs/concurrency.md).

* ``batch``: :func:`run_batch` (one program over many inputs, results in input order, ``ProgramError``,
  Ctrl-C); every call a program makes is one loop of the model's engine;
* ``lockstep``: ``run_batch``'s instances as greenlets on one thread, their parked calls sent out together;
* ``aio``: ``acall``/``astream`` support: the blocking call on a bounded shared worker pool
  (``continuum.programs.aio.ASYNC_WORKERS``), streams handed to the event loop through a queue;
* ``arguments``: the argument checks ``run_batch`` and ``continuum.cluster.run_batch`` share.

Example:
    >>> from continuum import run_batch
    >>> run_batch(lambda q: text(q, max_tokens=20), ["Once", "One day"])   # doctest: +SKIP
"""

from .batch import run_batch

__all__ = ["run_batch"]
