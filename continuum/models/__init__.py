"""Model and tokenizer adapters.

The backends load on first use (PEP 562): ``continuum.models.llamacpp``'s loader imports neither torch nor
transformers, so a GGUF can load while they import (``continuum serve``'s start-up)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import llamacpp as _llamacpp_package  # noqa: F401 - imported first: the function below then owns the name
from . import remote as _remote_package  # noqa: F401 - the same for models.remote

if TYPE_CHECKING:
    import os

    from .hf.load import transformers
    from .hf.model import Transformers
    from .identity import ModelFingerprint
    from .llamacpp.backend import LlamaCpp
    from .llamacpp.model import LlamaCppModel
    from .tokenizer import Tokenizer

__all__ = ["Transformers", "transformers", "LlamaCpp", "llamacpp", "RemoteModel", "remote", "Tokenizer", "ModelFingerprint"]

_LAZY = {"transformers": ("continuum.models.hf.load", "transformers"),
         "Transformers": ("continuum.models.hf.model", "Transformers"),
         "ModelFingerprint": ("continuum.models.identity", "ModelFingerprint"),
         "LlamaCpp": ("continuum.models.llamacpp.backend", "LlamaCpp"), "Tokenizer": ("continuum.models.tokenizer", "Tokenizer"),
         "RemoteModel": ("continuum.models.remote.model", "RemoteModel")}


def llamacpp(path: str | os.PathLike | LlamaCppModel, **options: Any) -> LlamaCpp:
    """A GGUF model on llama.cpp (``pip install continuum[llamacpp]``): :func:`continuum.models.llamacpp.backend.llamacpp`.

    (Defined here, not imported: the subpackage of the same name, imported on its own by a torch-free loader,
    would take the package's attribute otherwise.)

    Example:
        >>> model = models.llamacpp("stories260K-f32.gguf")               # doctest: +SKIP
    """
    from .llamacpp.backend import llamacpp as load

    return load(path, **options)


def remote(url: str, api_key: str | None = None, model: str | None = None, timeout: float = 120.0) -> Any:
    """The model a ``continuum serve`` at ``url`` serves, for every generator: :func:`continuum.models.remote.model.remote`
    (docs/remote.md). Programs written for a local model run unchanged.

    Example:
        >>> model = models.remote("http://127.0.0.1:8000", api_key="sk-local-1")   # doctest: +SKIP
    """
    from importlib import import_module  # (not `from .remote.model import`: that edge reorders mypy's import cycle)

    try:
        module = import_module("continuum.models.remote.model")
    except ImportError as exc:  # (its client needs httpx: the `remote` extra)
        from ..errors import ModelLoadError

        raise ModelLoadError(f"models.remote needs {exc.name or 'httpx'}: pip install 'continuum[remote]'") from exc
    return module.remote(url, api_key=api_key, model=model, timeout=timeout)


def __getattr__(name: str):
    from .._lazy import attribute

    return attribute(globals(), _LAZY, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
