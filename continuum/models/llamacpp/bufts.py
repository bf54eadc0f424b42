"""Where llama.cpp puts a GGUF's weights on the CPU, and the model params that load them around the AMX buffers.

llama.cpp's CPU backend offers "extra" buffer types before its plain one (``use_extra_bufts``, on by default): **AMX**
first where the build has AMX kernels (compiled with ``__AMX_INT8__``, e.g. ``-march=native`` on a Sapphire Rapids
CPU) and the OS grants the tile state, then **CPU_REPACK** (weights interleaved for the SIMD gemm/gemv kernels). Each
matmul weight goes to the first that takes it. Three ways to load (:data:`MODES`):

* ``"default"``: llama.cpp's own choice (AMX, repacking, plain).
* ``"repack"``: no AMX, repacking kept. ``use_extra_bufts=False`` drops both extra types from the list, and a tensor
  buffer-type override (``llama_model_params.tensor_buft_overrides``) puts each tensor the repacker takes into
  CPU_REPACK by name: an override to any buffer type other than plain CPU is used as is (llama-model-loader.cpp).
  It must be *exactly* the repacker's set: a tensor in CPU_REPACK without a repack layout is dereferenced as null
  while loading (measured: every ``ffn_down`` of Gemma 3 Q4_K_M overridden, Q6_K ones included, kills the process).
  So :func:`repack_patterns` mirrors ``ggml_repack_get_optimal_repack_type``'s x86 rules (repack.cpp; AMX is x86
  only) and names only matmul weights (a repacked token embedding would feed ``get_rows`` garbage). On Gemma 3
  270M Q4_K_M it selects the same 27 tensors llama.cpp repacks by default (12.66 MiB): ``tests/test_llamacpp_amx.py``.
* ``"plain"``: ``use_extra_bufts=False`` alone: no AMX, no repacking (what the batch-invariant mode loads).

Example:
    >>> mparams = lib().llama_model_default_params()                     # doctest: +SKIP
    >>> keep = apply(mparams, "repack", "gemma-3-270m-q4_k_m.gguf")     # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import struct
from functools import cache
from typing import Any

from ._lib import lib

__all__ = ["MODES", "AMX_TYPES", "gguf_tensors", "extra_bufts", "cpu_features", "repack_patterns", "apply"]

MODES = ("default", "repack", "plain")
# ggml type ids (ggml.h) with an AMX kernel (amx/common.h qtype_has_amx_kernels): a file with none never runs AMX code
AMX_TYPES = frozenset({2, 3, 8, 12, 13, 14, 23})  # Q4_0 Q4_1 Q8_0 Q4_K Q5_K Q6_K IQ4_XS
# the x86 repacker's types and the CPU feature each needs (repack.cpp): all want rows in groups of 8
_REPACK_X86 = {2: "AVX2", 12: "AVX2", 20: "AVX2", 39: "AVX2", 10: "AVX512"}  # Q4_0 Q4_K IQ4_NL MXFP4 | Q2_K
# weights llama.cpp only ever multiplies (build_lora_mm): anything else (embeddings, convolutions) is left alone
_MATMUL = re.compile(r"^(?:blk\.(\d+)\.((?:attn_(?:q|k|v|qkv|output)|ffn_(?:gate|up|down)(?:_shexp)?)\.weight)"
                     r"|(output\.weight))$")
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF metadata value sizes
_STRING, _ARRAY = 8, 9


class _Override(ctypes.Structure):  # struct llama_model_tensor_buft_override (llama.h)
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def gguf_tensors(path: str | os.PathLike) -> list[tuple[str, tuple[int, ...], int]]:
    """``(name, shape as ggml's ne, ggml type id)`` of every tensor of a GGUF file, read from its header alone (the
    ``gguf`` package is an optional extra; this needs no more than the header's layout, GGUF v2/v3 little-endian).

    Raises:
        ValueError: not a GGUF file this reader knows.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", m, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file")
        pos = 24

        def string(pos: int) -> tuple[bytes, int]:
            (n,) = struct.unpack_from("<Q", m, pos)
            return m[pos + 8:pos + 8 + n], pos + 8 + n

        def skip(kind: int, pos: int) -> int:
            if kind in _SCALAR:
                return pos + _SCALAR[kind]
            if kind == _STRING:
                return string(pos)[1]
            if kind != _ARRAY:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")
            item, count = struct.unpack_from("<IQ", m, pos)
            pos += 12
            if item in _SCALAR:
                return pos + _SCALAR[item] * count
            for _ in range(count):  # (strings: a tokenizer's vocabulary, one length each)
                pos = skip(item, pos)
            return pos

        for _ in range(n_kv):
            pos = string(pos)[1]
            (kind,) = struct.unpack_from("<I", m, pos)
            pos = skip(kind, pos + 4)
        tensors = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", m, pos)
            shape = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            (kind,) = struct.unpack_from("<I", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 4 + 8  # (the tensor's data offset follows)
            tensors.append((name.decode("utf-8", "replace"), tuple(shape), kind))
        return tensors


@cache
def extra_bufts() -> dict[str, int]:
    """The CPU device's extra buffer types as this build and machine give them, by name (``"AMX"``: compiled in and
    the OS granted the tile state; ``"CPU_REPACK"``), through ggml's public registry API (the symbols are reached
    through libllama's dependencies); empty where the bindings do not expose them."""
    L = lib()
    try:
        so = L._lib  # the CDLL of libllama: dlsym on it also searches libggml and libggml-base
        dev_by_type, dev_reg = so.ggml_backend_dev_by_type, so.ggml_backend_dev_backend_reg
        proc, name_of = so.ggml_backend_reg_get_proc_address, so.ggml_backend_buft_name
    except AttributeError:
        return {}
    dev_by_type.restype, dev_by_type.argtypes = ctypes.c_void_p, [ctypes.c_int]
    dev_reg.restype, dev_reg.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    proc.restype, proc.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    name_of.restype, name_of.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    dev = dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    fn = proc(dev_reg(dev), b"ggml_backend_dev_get_extra_bufts") if dev else None
    if not fn:
        return {}
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(dev)
    found, i = {}, 0
    while bufts and bufts[i]:
        found[name_of(bufts[i]).decode()] = int(bufts[i])
        i += 1
    return found


def cpu_features(system_info: str) -> frozenset[str]:
    """The features llama.cpp's CPU backend was compiled for (``"AVX2 = 1 | ..."`` in ``llama_print_system_info``:
    the repacker's choices are compile-time too)."""
    return frozenset(m.group(1) for m in re.finditer(r"(\w+) = 1\b", system_info))


def repack_patterns(tensors: list[tuple[str, tuple[int, ...], int]], features: frozenset[str]) -> list[str]:
    """Regexes naming exactly the matmul weights llama.cpp's x86 repacker takes (2-D, a repackable type, rows in
    groups of 8), one per weight kind (``^blk\\.(0|2)\\.ffn_down\\.weight$``), so a model of any depth needs a few."""
    layers: dict[str, list[str]] = {}
    for name, shape, kind in tensors:
        need, match = _REPACK_X86.get(kind), _MATMUL.match(name)
        if match and need in features and len(shape) == 2 and shape[1] % 8 == 0:
            layer, suffix, output = match.groups()
            layers.setdefault(output or suffix, []).append(layer)
    return [f"^{re.escape(s)}$" if ids == [None] else
            f"^blk\\.({'|'.join(i for i in ids if i is not None)})\\.{re.escape(s)}$" for s, ids in sorted(layers.items())]


def apply(mparams: Any, mode: str, path: str | os.PathLike, system_info: str = "") -> Any:
    """Set ``mparams`` for a load ``mode`` (:data:`MODES`); returns what must outlive the load (the override array
    llama.cpp reads through a pointer), or None."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    mparams.use_extra_bufts = mode == "default"
    if mode != "repack":
        return None
    repack = extra_bufts().get("CPU_REPACK")
    patterns = repack_patterns(gguf_tensors(path), cpu_features(system_info or lib().llama_print_system_info().decode()))
    if not repack or not patterns:  # nothing to repack here: "repack" is "plain"
        return None
    keep = (_Override * (len(patterns) + 1))(*[_Override(p.encode(), repack) for p in patterns])  # NULL-terminated
    mparams.tensor_buft_overrides = ctypes.cast(keep, ctypes.c_void_p)
    return keep
