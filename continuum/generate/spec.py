"""What a generator was built from: the constructor's name and arguments, kept on the generator.

A remote model (``continuum.models.remote``) runs a whole call on the server, which builds the same generator for
its own model; the compiled guide a generator holds cannot travel, so the generator remembers how it was made.
Recording costs one ``inspect`` bind per generator built, nothing per call.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["GeneratorSpec", "recorded"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class GeneratorSpec:
    """``kind``: the constructor (``"text"``, ``"choice"``, ``"regex"``, ``"json"``, ``"cfg"``); ``arguments``:
    every argument it was called with but the model, defaults included (Python objects: a pydantic class stays a
    class, a sampler a sampler)."""

    kind: str
    arguments: dict[str, Any]


def recorded(fn: F) -> F:
    """Decorate a generator constructor ``fn(model, ...)`` so the generator it returns carries ``spec``."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def make(*args: Any, **kwargs: Any) -> Any:
        gen = fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop("model", None)
        gen.spec = GeneratorSpec(fn.__name__, arguments)
        return gen

    return make  # type: ignore[return-value]
