"""``Programs``: a continuum program as a Ray Data ``map_batches`` class (one model per Ray Data actor).

::

    ds.map_batches(Programs, fn_constructor_args=(make_program,), batch_size=64, concurrency=4)
        └─ each actor: Programs(make_program) builds the program once; every batch of rows goes through
           continuum.run_batch(program, batch["item"]) and comes back with an "output" column

Ray Data keeps the rows, the actors and their restarts; this class only turns a batch into program runs.
It does not import Ray (Ray Data imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ContinuumTypeError, GeneratorArgumentError

__all__ = ["Programs"]


def _arrow_value(value: Any) -> Any:
    """What a Ray Data column can hold: a ``SequenceState`` as its text (``str(state)``; it holds the model)."""
    from ..state import SequenceState

    return str(value) if isinstance(value, SequenceState) else value


class Programs:
    """A callable class for ``Dataset.map_batches``: the program built once per actor, run batched over each batch.

    Args:
        make_program: a callable of no arguments returning the program (a callable of one input); it runs
            once in each Ray Data actor (load the model there).
        column: the column holding the program's inputs (``"item"``: what ``ray.data.from_items`` names it).
        output_column: the column added with the program's results (a ``SequenceState`` becomes ``str(state)``).
        concurrency: the most instances running at once in the actor (:func:`continuum.run_batch`'s).

    Raises (from a batch):
        ProgramError: some instances of the batch raised (Ray Data then fails or retries the batch, as it is set).

    Example:
        >>> ds = ray.data.from_items(docs)                                          # doctest: +SKIP
        >>> out = ds.map_batches(Programs, fn_constructor_args=(make_program,), batch_size=32, concurrency=2)
        >>> out.take_all()[0]["output"]                                             # doctest: +SKIP
    """

    def __init__(self, make_program: Callable[[], Callable[[Any], Any]], column: str = "item", output_column: str = "output",
                 concurrency: int = 32):
        if not callable(make_program):
            raise ContinuumTypeError(f"Programs(make_program): make_program must be a callable of no arguments that returns "
                                     f"the program, got {type(make_program).__name__}")
        for name, value in (("column", column), ("output_column", output_column)):
            if not isinstance(value, str):
                raise ContinuumTypeError(f"{name} must be a column name (a str), got {type(value).__name__}")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int):
            raise ContinuumTypeError(f"concurrency must be an int (the most program instances run at once, e.g. 32), "
                                     f"got {type(concurrency).__name__}")
        if concurrency < 1:
            raise GeneratorArgumentError(f"concurrency must be >= 1, got {concurrency}")
        self.program = make_program()
        if not callable(self.program):
            raise ContinuumTypeError(f"make_program() must return the program, a callable of one input, got "
                                     f"{type(self.program).__name__}")
        self.column, self.output_column, self.concurrency = column, output_column, concurrency

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` (column -> numpy array, Ray Data's default format) with ``output_column`` added, row for row."""
        import numpy as np

        from ..programs.batch import run_batch

        if self.column not in batch:
            raise GeneratorArgumentError(f"Programs: the batch has no column {self.column!r} (its columns: "
                                         f"{sorted(batch)}); pass column= the one holding the inputs")
        inputs = [x.item() if isinstance(x, np.generic) else x for x in batch[self.column]]  # numpy scalars -> Python
        results = run_batch(self.program, inputs, concurrency=self.concurrency)
        out = np.empty(len(results), dtype=object)  # (filled one by one: numpy would turn list results into a 2-D array)
        for i, r in enumerate(results):
            out[i] = _arrow_value(r)
        return {**batch, self.output_column: out}
