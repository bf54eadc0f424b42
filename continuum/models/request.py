"""A forward request: what one call's decoding loop asks of the model at one step, and, once run, its result.

The engine gathers every running call's requests and hands them to the model's backend in one batch
(``model.run_step``): transformers merges them into slabs (:mod:`continuum.models.hf.merge`); another backend runs
them its own way. Whatever the backend, a request's result is its logits (or log-probs) and its new KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..samplers import row_max
from . import kv as kvcache

__all__ = ["Request", "compact_outputs", "normalized"]


@dataclass(eq=False, slots=True)
class Request:
    """One call's forward: the arguments of ``Transformers.forward`` and, once run, its result."""

    # what the loop asks for: the rows' new columns on top of their KV
    ids: torch.Tensor
    mask: torch.Tensor
    pos: torch.Tensor
    kv: kvcache.KV | None
    logits: str = "last"  # which columns' logits: "last", "all", "none" or "outputs" (a tree's nodes read, row-major)
    reserve: int = 0  # columns the call may still append (a backend that preallocates makes room)
    allowed: torch.Tensor | None = None  # a token tree's attention (choice scoring): such a request runs alone
    outputs: torch.Tensor | None = None  # with allowed: the nodes whose logits are read (None: every node); others may
    # be left uncomputed (llama.cpp: an output row of a 262k vocabulary costs what a token's layers do)
    normalize: bool = False  # a decoding step: hand back log-probs (log-softmax over the group at once) and `top`
    column: tuple[list[int], list[int]] | None = None  # a decode step as lists: each row's new token and its position
    source: Any = None  # with `column`: makes ids, mask, pos as tensors, when a layout needs them (materialize)
    remask: bool = False  # cached columns were masked out since the last step (speculation's rejected drafts)
    # the engine's plumbing
    key: Any = None  # under tensor parallelism: the same name on every rank (continuum.loop.ranks)
    event: Any = None  # a one-off request's owner waits on it (continuum.loop.engine)
    # the result, set by the backend's run_step
    result: Any = None
    top: tuple[list[int], list[float]] | None = None  # with normalize: each row's most likely token and its log-prob
    error: BaseException | None = None
    done: bool = False

    rows: int = field(init=False)
    new: int = field(init=False)
    logprobs: Any = None  # with normalize: (the group's log-probs, first row), sliced on demand (log_probs())

    def __post_init__(self) -> None:
        self.rows = len(self.column[0]) if self.column is not None else self.ids.shape[0]
        self.new = 1 if self.column is not None else self.ids.shape[1]

    def log_probs(self) -> torch.Tensor:
        """The log-probs of each row's last column (a normalized request's result holds no logits)."""
        lp, row = self.logprobs
        return lp[row:row + self.rows]

    def materialize(self) -> Request:
        """Give a list-form decode step (``column``) its tensors, the ones it stands for."""
        if self.column is not None and self.ids is None:
            self.ids, self.mask, self.pos = self.source()
        return self

    @property
    def cached(self) -> int:
        return kvcache.length(self.kv)

    @property
    def mergeable(self) -> bool:
        """2-D masks (token trees, ``allowed``, merge with token trees of the same width)."""
        return self.column is not None or (self.mask.dim() == 2 and self.ids.dim() == 2
                                           and (self.allowed is None or self.allowed.dim() == 3))


def normalized(logits: torch.Tensor) -> tuple[torch.Tensor, list[float], list[int]]:
    """Log-softmax of ``(rows, vocab)`` logits, and each row's best log-prob and token (as lists)."""
    lp = torch.log_softmax(logits, dim=-1)
    best, top = row_max(lp)
    return lp, best.tolist(), top.tolist()


def compact_outputs(logits: torch.Tensor, outputs: torch.Tensor | None) -> torch.Tensor:
    """``logits="all"``'s ``(rows, new, vocab)`` as ``logits="outputs"``: the rows ``outputs`` marks (None: every
    column), row-major."""
    if outputs is None:
        return logits.reshape(-1, logits.shape[-1])
    return logits[outputs.bool().to(logits.device)]
