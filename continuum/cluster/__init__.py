"""Programs across a Ray cluster: :func:`run_batch` over actors, :class:`Programs` for Ray Data.

Nothing here imports Ray until it is called (``import continuum.cluster`` works without it); Ray comes
with ``pip install "continuum[cluster]"``. See ``docs/scaleout.md``.
"""

from __future__ import annotations

from .batch import RemoteTraceback, run_batch
from .data import Programs

__all__ = ["run_batch", "Programs", "RemoteTraceback"]
