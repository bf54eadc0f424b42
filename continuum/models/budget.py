"""Byte budgets as users write them (``"512MiB"``, ``"2GB"``, an int): one parser for both backends' ``prefix_cache=``
and ``kv_budget=`` and the server's size options. Torch-free: the server's command line reads its options before
torch is imported."""

from __future__ import annotations

import re

from ..errors import ContinuumTypeError, PrefixCacheArgumentError

__all__ = ["parse_budget"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(spec: None | int | str, name: str = "prefix_cache") -> int | None:
    """Bytes of a ``prefix_cache=`` (or ``name=``) argument: ``None``/``0`` -> ``None`` (off); an int; ``"512MiB"``.

    Raises :class:`PrefixCacheArgumentError` (a ``ValueError``) for a negative or unreadable value.
    """
    if spec is None or (isinstance(spec, int) and not isinstance(spec, bool) and spec == 0):
        return None
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise ContinuumTypeError(f"{name} takes a byte budget: an int or a string like '512MiB' or '2GB' "
                                 f"(None or 0: off), got {type(spec).__name__}")
    if isinstance(spec, int):
        if spec < 0:
            raise PrefixCacheArgumentError(f"{name} must be >= 0 bytes (0 or None: off), got {spec}")
        return spec
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", spec)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise PrefixCacheArgumentError(f"{name}={spec!r} is not a size: write bytes as an int or a number with a "
                                       f"unit, e.g. '512MiB', '2GB', '64kB' (units: {', '.join(u for u in _UNITS if u)})")
    value = int(float(match.group(1)) * _UNITS[unit])
    return value or None
