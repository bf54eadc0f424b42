"""Names a package binds on first use (PEP 562 ``__getattr__``): its roots import nothing heavy, so a light
module (the server's command line, the llama.cpp loader) loads without torch and transformers first.

Each root keeps a table ``{name: (module, attribute)}``; any other name is tried as a submodule.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["attribute"]


def attribute(package: dict[str, Any], table: dict[str, tuple[str, str]], name: str) -> Any:
    """``name`` of the package whose globals are ``package``: from ``table``, else its submodule ``name``; bound in
    the package (the next lookup is a plain attribute). AttributeError for anything else."""
    root = package["__name__"]
    if name in table:
        module, attr = table[name]
        value = getattr(importlib.import_module(module), attr)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"{root}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{root}.{name}":
                raise
            raise AttributeError(f"module {root!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {root!r} has no attribute {name!r}")
    package[name] = value
    return value
