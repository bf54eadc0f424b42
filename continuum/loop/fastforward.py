"""Forced-token fast-forward: append a whole forced run and compute it in the next forward pass.

When a guide forces the next tokens (JSON keys and punctuation, the tail of a choice), sampling
them one forward pass each is wasted work: the mask leaves one token. After a row samples a token,
the decoding loop asks the guide for the run it forces (``Guide.forced_tokens``, which does not
consume anything), advances the row through it, and writes the sampled token and the run as one
*block* of new columns. Every row's block is right-aligned (shorter rows get masked holes on the
left, which the state layout allows anywhere), so the last column of every row is a real token and
the next step's logits are the last column's. The block is computed in ONE forward pass; a forced
token's raw log-prob comes from the logits of the column before it in that same pass.

Example (greedy, JSON with compact separators): ``{"`` sampled, ``name":"`` forced -> one forward
for the six tokens instead of six forwards; the weights hold all seven log-probs.

Beam search fast-forwards a batch item only by the run *every* live beam of it is forced through
(the shortest run): while each beam has exactly one candidate, step-by-step search keeps every beam,
so this is exactly what step-by-step search would do. A longer run for one beam would add its
log-probs to its score before the other beams' choices are ranked against it, which can change the
result. Multinomial sampling draws from the same distributions, but consumes the ``rng`` differently
than step-by-step decoding (fewer draws).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["forced_runs", "run_logprobs", "step_marks"]


def forced_runs(guide, states: Sequence, live: Sequence[bool], budgets: Sequence[int], group: int,
                beams: bool) -> list[list[int]]:
    """Per row, the forced tokens to append after its sampled token (``[]``: none).

    ``live[r]``: row ``r`` kept its sampled token and goes on; ``budgets[r]``: tokens it may still
    generate (``max_tokens`` and the context limit; a run is cut there). ``group``: rows per batch
    item; with ``beams`` every live row of an item gets the item's shortest run (module docstring).

    Example:
        >>> forced_runs(guide, [s0, s1], [True, True], [10, 2], 1, False)  # doctest: +SKIP
        [[7, 8, 9], [4, 5]]
    """
    runs: list[list[int]] = [[] for _ in states]
    for r, s in enumerate(states):
        if live[r] and budgets[r] > 0:
            runs[r] = list(guide.forced_tokens(s))[:budgets[r]]
    if beams:
        for start in range(0, len(runs), group):
            members = [r for r in range(start, start + group) if live[r]]
            shortest = min((len(runs[r]) for r in members), default=0)
            for r in members:
                runs[r] = runs[r][:shortest]
    return runs


def run_logprobs(logits: torch.Tensor, runs: Sequence[Sequence[int]], width: int) -> list[list[float]]:
    """Raw log-probs of every row's forced run, from the block forward's per-column ``logits``.

    ``logits``: ``(rows, n, vocab)`` for the block's first ``n`` columns (``n >= width - 1``). A run
    of ``m`` tokens fills the block's last ``m`` columns, so token ``i`` of it sits at column
    ``width - m + i`` and is predicted by column ``width - m + i - 1``.
    """
    rows: list[int] = []
    cols: list[int] = []
    toks: list[int] = []
    for r, run in enumerate(runs):
        m = len(run)
        rows += [r] * m
        cols += range(width - m - 1, width - 1)
        toks += run
    out: list[list[float]] = [[] for _ in runs]
    if not toks:
        return out
    picked = logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)].float()
    # (normalised in place: the indexing made a copy, and a second vocabulary-wide array costs its page faults)
    lps = torch.log_softmax(picked, -1, out=picked).gather(1, torch.tensor(toks, device=logits.device)[:, None])[:, 0].tolist()
    i = 0
    for r, run in enumerate(runs):
        out[r] = lps[i:i + len(run)]
        i += len(run)
    return out


def step_marks(tokenizer, ids: Sequence[int], text: str, generated: int, kinds: dict[int, str], start: int) -> tuple:
    """The ``LastStep.marks`` of one row: ``(start, end, kind)`` character spans relative to ``start``.

    ``ids``/``text``: the row's real tokens and text, ending with the ``generated`` tokens of this
    step; ``kinds``: ordinal of a generated token (0 = the step's first) -> ``"forced"`` or
    ``"healed"``. Only the step's tokens (and a few before, for context) are decoded; a row whose
    text does not end with that window's text (a character split at the window's edge) stays unmarked.
    """
    if not kinds or generated <= 0:
        return ()
    from ..state.text import token_char_spans

    first = len(ids) - generated
    lo = max(0, first - 8)
    window = list(ids[lo:])
    tail = tokenizer.decode(window)
    if not text.endswith(tail):
        return ()
    shift = len(text) - len(tail) - start
    spans = token_char_spans(tokenizer, window)
    return tuple((spans[first - lo + k][0] + shift, spans[first - lo + k][1] + shift, kind)
                 for k, kind in sorted(kinds.items()) if first - lo + k < len(spans))
