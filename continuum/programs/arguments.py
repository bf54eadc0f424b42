"""The argument checks ``run_batch`` and ``cluster.run_batch`` share: a program (or its factory), an iterable of
inputs (not a string), positive ints, flags. Each raises a continuum error whose message names the argument and
shows a valid value."""

from __future__ import annotations

from typing import Any

from ..errors import ContinuumTypeError, GeneratorArgumentError

__all__ = ["check_flags", "check_int", "check_program_and_inputs"]


def check_program_and_inputs(fn: Any, inputs: Any, call: str, name: str, expected: str) -> None:
    """``fn`` callable (``name`` in ``call``'s signature: ``expected`` says what it should be), ``inputs`` an
    iterable that is not one string."""
    if not callable(fn):
        raise ContinuumTypeError(f"{call}: {name} must be {expected}, got {type(fn).__name__}")
    if isinstance(inputs, (str, bytes, bytearray)):
        raise ContinuumTypeError(f"{call}: inputs is a single string; pass an iterable of inputs, e.g. "
                                 f"run_batch({name}, [text]) (a string would run the program once per character)")
    try:
        iter(inputs)
    except TypeError:
        raise ContinuumTypeError(f"{call}: inputs must be an iterable of program inputs (a list, a generator...), "
                                 f"got {type(inputs).__name__}") from None


def check_int(name: str, value: Any, least: int, hint: str) -> None:
    """``value`` an int (not a bool) >= ``least``; ``hint`` says what it counts, with an example."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ContinuumTypeError(f"{name} must be an int ({hint}), got {type(value).__name__}")
    if value < least:
        raise GeneratorArgumentError(f"{name} must be >= {least} ({hint}), got {value}")


def check_flags(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise GeneratorArgumentError(f"{name} must be True or False, got {value!r}")
