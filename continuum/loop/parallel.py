"""Guards for running one continuum program on every rank of a torchrun launch (SPMD).

Under tensor parallelism every rank must make the same calls with the same inputs, or the ranks run
different forwards: gloo/NCCL then abort on mismatched collectives, or (when the shapes happen to
agree) combine activations of different sequences. continuum itself is deterministic given its
inputs; the one thing a program easily gets wrong is randomness: a random sampler without ``rng``
draws from torch's global generator, seeded differently in each process unless the program seeds
it identically on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["world_size", "check_seeded"]

logger = logging.getLogger("continuum")
_warned = False


def world_size(model: Any) -> int:
    """How many tensor-parallel processes share ``model`` (the backend says: 1 without ``tp_plan``); no
    communication."""
    return int(getattr(model, "world_size", 1) or 1)


def check_seeded(model: Any, sampler: Any, rng: torch.Generator | None) -> None:
    """Warn (once per process) when a random sampler runs without ``rng`` under tensor parallelism."""
    global _warned
    if _warned or rng is not None or not getattr(sampler, "is_random", False) or world_size(model) == 1:
        return
    _warned = True
    logger.warning(
        "%s runs without rng= under tensor parallelism (%d processes): it draws from torch's global generator, "
        "which differs between processes unless every rank called torch.manual_seed with the same seed. Ranks that "
        "draw different tokens run different forwards (a collective mismatch, or wrong results). Pass the same "
        "rng=torch.Generator().manual_seed(SEED) on every rank.", type(sampler).__name__, world_size(model))
