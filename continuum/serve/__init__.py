"""``continuum serve``: an OpenAI-compatible HTTP server whose conversations are continuous states.

Needs the ``serve`` extra (``pip install "continuum[serve]"``: FastAPI and uvicorn); the library
itself never imports this package. See ``docs/serve.md``.
"""

from __future__ import annotations

__all__ = ["ServeConfig", "create_app", "main"]


def __getattr__(name: str):
    if name in ("create_app", "ServeConfig"):
        from . import app

        return getattr(app, name)
    if name == "main":
        from .cli import main

        return main
    raise AttributeError(name)
