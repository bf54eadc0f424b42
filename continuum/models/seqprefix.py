"""The common prefix of two token sequences (or strings): one helper for every place that reconciles what is
cached with what is asked (the prefix cache's donors, a decode's shared prefill, a chat's and the server's
reconciliation). A leaf: it imports nothing, so the models layer's lazy roots can use it at import time."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["common_prefix"]


def common_prefix(a: Sequence, b: Sequence) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
