"""The prompt's own log-probs, for legacy completions with ``echo`` and ``logprobs``.

Evaluation harnesses (lm-eval's ``local-completions``) score a continuation by sending
``context + continuation`` with ``echo=True, logprobs=k`` and summing the prompt tokens' log-probs.
OpenAI's shape: every prompt token, the first with a null log-prob (nothing precedes it), then the
generated tokens. One forward over the prompt gives them all (``logits="all"``): the log-prob of
token ``i`` is read from the log-softmax of column ``i - 1``, as generation itself scores tokens.
"""

from __future__ import annotations

import torch

from ..errors import ContextLengthError
from ..state import SequenceState

__all__ = ["prompt_logprobs", "prompt_state"]


def prompt_state(model, prompts: list) -> SequenceState:
    """The state of ``prompts``: texts (tokenized with the tokenizer's special tokens, as the library
    does) or lists of token ids (used as given, as OpenAI does: no BOS is added)."""
    if all(isinstance(p, str) for p in prompts):
        return SequenceState.from_prompts(model, prompts)
    rows = [list(p) for p in prompts]
    nan = float("nan")
    return SequenceState._from_rows(model, rows, [[nan] * len(r) for r in rows], torch.zeros(len(rows)), len(rows), 1,
                                    None)


def prompt_logprobs(model, ids: list[int], k: int) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Per prompt token: its log-prob given the tokens before it (None for the first), and the ``k`` best
    alternatives there (None for the first)."""
    limit = model.context_length
    if limit is not None and len(ids) > limit:
        raise ContextLengthError(f"the prompt has {len(ids)} tokens but the model's context is {limit}: shorten it")
    if len(ids) < 2:
        return [None] * len(ids), [None] * len(ids)
    x = torch.tensor([ids], device=model.device)
    mask = torch.ones_like(x)
    logits, _ = model.forward(x[:, :-1], mask[:, :-1], torch.arange(len(ids) - 1, device=model.device)[None], None,
                              logits="all")
    assert logits is not None
    lp = torch.log_softmax(logits[0].float(), dim=-1)  # (L - 1, vocab): row i predicts token i + 1
    chosen = lp.gather(1, x[0, 1:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]] | None] = [None]
    if k:
        values, tids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        tops += [list(zip(t, v)) for t, v in zip(tids.tolist(), values.tolist())]
    else:
        tops += [[] for _ in chosen]
    return [None, *chosen], tops
