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
import os
from typing import Any

from ...errors import ModelLoadError

__all__ = ["lib", "version", "pin_kernels", "mark_decoded", "TILED_MM"]

_LIB: Any = None
# llama.cpp's CPU backend multiplies K-quant weights with a tiled kernel when a micro-batch has 8 or more rows and with
# vec_dot below that; the two round differently (up to ~1.1 in Gemma 3 270M Q4_K_M's logits). This variable turns the
# tiled kernel off; ggml reads it ONCE per process (std::call_once), at the first matmul, for every model.
TILED_MM = "GGML_CPU_TILED_MM"
_decoded = False  # continuum has run a llama_decode in this process (the variable has been read by then)


def mark_decoded() -> None:
    """Called before every ``llama_decode``: from now on :func:`pin_kernels` can no longer take effect."""
    global _decoded
    _decoded = True


def pin_kernels() -> bool:
    """Make llama.cpp take one matmul kernel whatever a micro-batch's row count (``GGML_CPU_TILED_MM=0``), so that a
    row's logits do not depend on how many rows its decode carries (the batch-invariant mode needs it on K-quant
    files; f32, f16, q8_0 and Q5_0 weights never take the tiled kernel). True when the process runs that way (set
    here, or by the user); False when the user set it otherwise, or continuum already decoded in this process with
    the tiled kernel on: ggml has read the variable, and setting it now changes nothing. (A ``llama_cpp.Llama`` that
    computed before is not seen here: set the variable before starting the process to be sure.)"""
    if TILED_MM in os.environ:  # the user's own choice, kept
        return os.environ[TILED_MM] == "0"
    if _decoded:
        return False
    os.environ[TILED_MM] = "0"
    return True


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
        # llama-cpp-python's log callback prints everything while its logger is unset, so it is quieted unless asked
        # (DEBUG shows all). Its level table is older than llama.cpp's (ggml.h now numbers DEBUG 1, INFO 2, WARN 3,
        # ERROR 4): it prints llama.cpp's warnings as errors and its errors as debug. At ERROR the expected warning
        # of a full pool ("failed to find a memory slot", the engine then parks a call) printed at every park;
        # at CRITICAL none of those do (llama.cpp's errors surface as continuum's exceptions anyway).
        lcp_logger = logging.getLogger("llama-cpp-python")
        if lcp_logger.level == logging.NOTSET:
            lcp_logger.setLevel(logging.CRITICAL)
        del llama_cpp
        low.llama_backend_init()
        _LIB = low
    return _LIB


def version() -> str:
    """The llama-cpp-python version (it pins the llama.cpp commit it vendors)."""
    lib()
    import llama_cpp

    return str(llama_cpp.__version__)


def meta_str(model_ptr: Any, key: str) -> str | None:
    """A GGUF metadata value of a loaded model as text (``"general.architecture"``...), or None when absent."""
    import ctypes

    L, size = lib(), 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = int(L.llama_model_meta_val_str(model_ptr, key.encode(), buf, size))
        if n < 0:
            return None
        if n < size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n + 1
