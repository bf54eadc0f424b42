"""Ragged rows laid out as a state's tensors: left-padded (right-aligned) ids, attention mask and log-probs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["right_aligned", "NAN"]

NAN = float("nan")


def right_aligned(rows: Sequence[Sequence[int]], lps: Sequence[Sequence[float]], pad: int,
                  device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad ragged rows into (ids, mask, logprobs) tensors."""
    width = max((len(r) for r in rows), default=0)
    if width and all(len(r) == width for r in rows):  # (no padding: a lone prompt, a joint call's rows)
        return (torch.tensor(rows, dtype=torch.long).to(device), torch.ones((len(rows), width), dtype=torch.long).to(device),
                torch.tensor(lps, dtype=torch.float32).to(device))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lp = torch.full((len(rows), width), NAN, dtype=torch.float32)
    for i, (r, row_lps) in enumerate(zip(rows, lps)):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
            lp[i, width - len(r):] = torch.tensor(row_lps, dtype=torch.float32)
    return ids.to(device), mask.to(device), lp.to(device)
