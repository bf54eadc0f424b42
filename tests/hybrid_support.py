"""Helpers of the hybrid-model tests (``test_hybrid.py``, ``test_hybrid_families.py``): the LFM2 fixture's path,
weights redrawn so every token depends on its context, and the references (transformers' generate, a fresh
forward) every check compares against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conftest import FIXTURES

if TYPE_CHECKING:
    from continuum.models import Transformers
    from continuum.state import SequenceState

LFM2 = FIXTURES / "models" / "lfm2-tiny"

PROMPTS = ["Once upon a time", "The dog sat by the"]


def scaled(model: torch.nn.Module, seed: int) -> None:
    """Weights redrawn from N(0, (1.5 / fan_in ** 0.5) ** 2), as the LFM2 fixture's: every token depends on its
    context (default initialisations leave a tiny model's recurrent state nearly constant)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "A_log" not in name:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / fan_in ** 0.5)


def reference_logits(model: Transformers, ids: list[int]) -> torch.Tensor:
    """The logits of one fresh forward of ``ids`` (no cache)."""
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids])).logits[0].float()


def assert_exact(model: Transformers, state: SequenceState) -> None:
    """The logits of the state's uncached suffix, computed on its KV (reused, sliced, forked...), equal one fresh
    forward of each row's real ids (invariant: reuse never changes results)."""
    kv, C = state._kv, (state._kv.length() if state._kv is not None else 0)
    mask = state._mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits, _ = model.forward_now(state._ids[:, C:], mask, pos[:, C:], kv, logits="all")
    for r, (ids, _) in enumerate(state._real_rows()):
        ref = reference_logits(model, ids)
        real = mask[r, C:].bool()
        n = int(real.sum())
        assert n >= 1
        torch.testing.assert_close(logits[r, real], ref[len(ids) - n:], atol=1e-4, rtol=1e-4)


def hf_greedy(model: Transformers, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy ``generate``: ``ids`` and ``n`` new tokens."""
    out = model.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0].tolist()


def ids_of(state: SequenceState, row: int = 0) -> list[int]:
    """The real token ids of a state's row."""
    return state._real_rows()[row][0]
