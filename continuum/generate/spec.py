"""What a generator was built from: the constructor's name and arguments, kept on the generator.

A remote model (``continuum.models.remote``) runs a whole call on the server, which builds the same generator for
its own model; the compiled guide a generator holds cannot travel, so the generator remembers how it was made. Each
constructor in ``api.py`` takes its ``locals()`` first thing (its arguments, nothing else yet) and attaches them to
what it returns. (Not a decorator: a wrapper's frame would take the place of the caller's in the warnings the
constructors give, e.g. ``SchemaCoverageWarning``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["GeneratorSpec", "arguments", "remember"]

G = TypeVar("G")


@dataclass(frozen=True)
class GeneratorSpec:
    """``kind``: the constructor (``"text"``, ``"choice"``, ``"regex"``, ``"json"``, ``"cfg"``); ``arguments``:
    every argument it was called with but the model, defaults included (Python objects: a pydantic class stays a
    class, a sampler a sampler)."""

    kind: str
    arguments: dict[str, Any]


def arguments(local_names: dict[str, Any]) -> dict[str, Any]:
    """A constructor's arguments from its ``locals()`` taken before it binds anything, the model left out."""
    return {k: v for k, v in local_names.items() if k != "model"}


def remember(gen: G, spec: GeneratorSpec) -> G:
    """``gen`` carrying ``spec`` (``gen.spec``)."""
    gen.spec = spec  # type: ignore[attr-defined]
    return gen
