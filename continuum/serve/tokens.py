"""Reading a reply's tokens off a state, what of a streamed text is safe to send, and the top log-probs of each step."""

from __future__ import annotations

import math

from ..chat.reuse import common_prefix
from ..samplers import Sampler
from ..state import SequenceState

__all__ = ["Recording", "common_prefix", "generated_count", "prediction_tokens", "row_tokens", "safe_length"]


def row_tokens(state: SequenceState, r: int) -> tuple[list[int], list[float]]:
    mask = state.attention_masks[r].bool()
    return state.token_ids[r][mask].tolist(), state.token_logprobs[r][mask].tolist()


def generated_count(lps: list[float]) -> int:
    """How many tokens end the row with a log-prob: the reply's generated tokens (prompt tokens have NaN)."""
    n = 0
    for x in reversed(lps):
        if math.isnan(x):
            break
        n += 1
    return n


def safe_length(text: str, stops: list[str]) -> int:
    """How much of ``text`` can be streamed: up to the first stop sequence, and not a tail that may start one."""
    end = len(text)
    for s in stops:
        at = text.find(s)
        if at >= 0:
            end = min(end, at)
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end -= k
                break
    return end




class Recording(Sampler):
    """Wraps a sampler and keeps the ``k`` best log-probs of every step (for ``top_logprobs``)."""

    def __init__(self, inner: Sampler, k: int):
        self.inner, self.k, self.steps = inner, k, []  # type: ignore[var-annotated]
        self.samples, self.is_beam_search, self.is_random = inner.samples, inner.is_beam_search, inner.is_random

    def __call__(self, logprobs, scores, group, rng=None):
        if self.k:
            values, ids = logprobs.topk(min(self.k, logprobs.shape[-1]), dim=-1)
            self.steps.append((values.tolist(), ids.tolist()))
        return self.inner(logprobs, scores, group, rng)

    def reorders(self, group: int) -> bool:
        return self.inner.reorders(group)


def prediction_tokens(state: SequenceState | None) -> dict[str, int]:
    """OpenAI's ``completion_tokens_details`` counts of drafted tokens (``--speculate``): kept and rejected ones of
    the state's last call; empty without speculation."""
    stats = state._last.speculation if state is not None and state._last is not None else None
    if not stats:
        return {}
    return {"accepted_prediction_tokens": stats["accepted"], "rejected_prediction_tokens": stats["drafted"] - stats["accepted"]}
