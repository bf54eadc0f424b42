"""The llama-cpp-python bindings, imported on first use with a clear error when the extra is missing.

Only the low-level ctypes module (``llama_cpp.llama_cpp``) is used: the high-level ``Llama`` class keeps one
sequence and its token helpers truncate long pieces (see ``../shared/research/llamacpp.md`` §3).

Example:
    >>> L = lib()                          # doctest: +SKIP
    >>> L.llama_max_parallel_sequences()   # doctest: +SKIP
    256
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import ModelLoadError

__all__ = ["lib", "version"]

_LIB: Any = None


def lib() -> Any:
    """The ``llama_cpp.llama_cpp`` module (the C API), its backend initialised once."""
    global _LIB
    if _LIB is None:
        try:
            import llama_cpp
            import llama_cpp.llama_cpp as low
        except ImportError as exc:
            raise ModelLoadError("GGUF models need llama-cpp-python: pip install 'continuum[llamacpp]' "
                                 f"(it builds llama.cpp from source, a few minutes) [{exc}]") from exc
        # llama-cpp-python's log callback prints everything while its logger is unset: errors only, unless asked.
        lcp_logger = logging.getLogger("llama-cpp-python")
        if lcp_logger.level == logging.NOTSET:
            lcp_logger.setLevel(logging.ERROR)
        del llama_cpp
        low.llama_backend_init()
        _LIB = low
    return _LIB


def version() -> str:
    """The llama-cpp-python version (it pins the llama.cpp commit it vendors)."""
    lib()
    import llama_cpp

    return str(llama_cpp.__version__)
