"""The memoised walk the exact schema rewrites share (:mod:`.overlaps`, :mod:`.refs`)."""

from __future__ import annotations

from typing import Any

__all__ = ["SchemaRewriter"]


class SchemaRewriter:
    """Rewrites every schema node once: lists element-wise, other values as they are, each dict by
    :meth:`_node` (memoised by identity, so shared subschemas stay shared and a cycle ends)."""

    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}

    def node(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.node(v) for v in node]
        if not isinstance(node, dict):
            return node
        key = id(node)
        if key not in self.memo:
            self.memo[key] = node  # a cycle reads the node as it was
            self.memo[key] = self._node(node)
        return self.memo[key]

    def _node(self, node: dict) -> Any:
        raise NotImplementedError
