"""Exact choice: score every option in context with ONE forward pass, then let the sampler pick.

Each row is paired with each option (``state + option``, tokenized as a continuation), the
uncached suffixes of all pairs are run in a single forward call, and an option's score is the
sum of the model's log-probs of its tokens (``method="exact"``; no end-of-option term, so an
option that is a prefix of another scores at least as high) or their mean (``method="mean"``).

The scores form a ``(rows, options)`` matrix that the usual samplers consume as if options were
a vocabulary: greedy takes the best, multinomial(n) draws n, beam_search(n) keeps the n best
(row, option) pairs. The chosen pairs keep the KV cache of that forward pass.

With classifier-free guidance, each option token's score is the guided log-prob
(:func:`~continuum.guidance.guided_logprobs` of the conditional log-prob and the log-prob after the
row's unconditional prompt, one more forward over every distinct (unconditional prompt, option)
pair); the sampler ranks by the summed (or mean) guided scores, the weights stay the raw ones.

With ``token_healing``, a row whose last token can be healed loses it, and each option is scored
as the removed text followed by the option, tokenized together (the first token may re-cover the
removed text and the option's start): the option's score includes re-covering that text.
"""

from __future__ import annotations

import math
from typing import Generator, Optional, Sequence

import torch

from . import cache as kvcache
from .cancel import check_cancelled
from .cache import positions
from .loop.decoding import Step, check_continuable, prefill
from .errors import ContextLengthError
from .guidance import Guidance, guided_logprobs
from .samplers import Sampler
from .parallel import check_seeded
from .state import LastStep, SequenceState

__all__ = ["choose"]


def choose(state: SequenceState, options: Sequence[str], sampler: Sampler, *, method: str = "exact",
           rng: Optional[torch.Generator] = None, guidance: Optional[Guidance] = None,
           token_healing: bool = False) -> Generator[Step, None, SequenceState]:
    """Pick one option per output row; yields one :class:`Step`, returns the new state."""
    check_cancelled(state.rows)  # Ctrl-C / a closed stream: stop before the scoring forward
    check_continuable(state, sampler, None)
    check_seeded(state._model, sampler, rng)  # under torchrun: every rank must draw the same option
    starts = [len(t) for t in state.texts]
    removed = [""] * state.rows  # token healing: the text of each row's backed-up token
    if token_healing:
        from .healing import heal

        healed, plans = heal(state, None, [None] * state.rows, [False] * state.rows)
        removed = [t[len(h):] if p is not None else "" for t, h, p in zip(state.texts, healed.texts, plans)]
        state = healed
    state = prefill(state)  # the shared suffix once; each (row, option) pair then runs 1 + option tokens
    model, tok = state._model, state._model.tokenizer
    K, R = len(options), state.rows
    encoded = {x: [tok.encode_continuation(x + o) for o in options] for x in set(removed)}
    option_ids = [encoded[removed[i // K]][i % K] for i in range(R * K)]  # per (row, option) pair
    longest, ctx = int(state._mask.sum(1).max()), model.context_length
    if ctx is not None and longest + max(map(len, option_ids)) > ctx:  # every option is scored in full
        raise ContextLengthError(f"the input ({longest} tokens) leaves no room for the longest option "
                                 f"({max(map(len, option_ids))} tokens) in the model's context ({ctx}): "
                                 f"shorten the input, e.g. state[..., -N:] keeps its last N characters")

    # every (row, option) pair; rows of one batch item stay together: batch x (samples * K)
    pairs = state._select([r for r in range(R) for _ in range(K)], state.batch, state.samples * K)
    real, cached = pairs._real_rows(), pairs._cached_real()
    tails = [(ids[c:] + option_ids[i], lps[c:] + [math.nan] * len(option_ids[i]))
             for i, ((ids, lps), c) in enumerate(zip(real, cached))]
    cand = pairs._rebuild(cached, tails, pairs._weights, None)

    C, W = kvcache.length(cand._kv), cand._ids.shape[1]
    logits, kv = model.forward(cand._ids[:, C:], cand._mask, positions(cand._mask)[:, C:], cand._kv, logits="all")
    logprobs = torch.log_softmax(logits, -1)  # (R*K, W-C, V): column j predicts column C+j+1
    lengths = torch.tensor([len(ids) for ids in option_ids])
    token_lp = cand._logprobs.clone()
    gain = torch.empty(R * K)  # raw log-prob of each pair's option
    pair_lps = []
    for i in range(R * K):
        n = int(lengths[i])
        cols = torch.arange(W - n, W)
        lp = logprobs[i, cols - C - 1, cand._ids[i, cols]]
        token_lp[i, cols] = lp
        gain[i] = lp.sum()
        pair_lps.append(lp)
    if guidance is not None:  # rank by guided scores; the weights (gain) stay raw
        prefixes = guidance.prefixes(state.batch, state.samples, state._ids[:, -1].tolist(), tok.bos_token_id)
        uncond = _uncond_option_logprobs(model, [prefixes[i // K] for i in range(R * K)], option_ids)
        guided = torch.stack([guided_logprobs(lp, u.to(lp.device), guidance.scale, guidance.rescale).sum()
                              for lp, u in zip(pair_lps, uncond)])
        scores = guided.cpu() / lengths if method == "mean" else guided.cpu()
    else:
        scores = gain / lengths if method == "mean" else gain

    ids, ancestors, ranked = sampler(scores.reshape(R, K), state._weights.to(torch.float32), state.samples, rng)
    chosen = ancestors * K + ids
    weights = state._weights.to(torch.float32).index_select(0, ancestors) + gain.index_select(0, chosen)
    weights = weights.masked_fill(ranked == float("-inf"), float("-inf"))  # dead beams (fewer pairs than beams)
    full = SequenceState(model=model, ids=cand._ids, mask=cand._mask, logprobs=token_lp, weights=cand._weights,
                         kv=kvcache.crop(kv, W - 1), batch=state.batch,
                         samples=state.samples * K)
    order = list(range(chosen.numel()))
    if sampler.is_beam_search:  # best first, by the score the search ranked with
        n = sampler.samples
        order = [b * n + i for b in range(state.batch) for i in sorted(range(n), key=lambda i: -float(ranked[b * n + i]))]
    pick = torch.tensor(order)
    out = full._select(chosen.index_select(0, pick).tolist(), state.batch, sampler.samples)
    weights, ancestors = weights.index_select(0, pick), ancestors.index_select(0, pick)
    texts = out.texts
    last = LastStep(kind="choice", starts=tuple(starts[a] for a in ancestors.tolist()), ends=tuple(len(t) for t in texts),
                    complete=(True,) * out.rows, finish=("pattern",) * out.rows)
    result = SequenceState(model=model, ids=out._ids, mask=out._mask, logprobs=out._logprobs, weights=weights,
                           kv=out._kv, batch=out.batch, samples=out.samples, last=last)
    yield Step([t[s:] for t, s in zip(texts, last.starts)], True)
    return result


def _uncond_option_logprobs(model, prefixes: list[list[int]], option_ids: list[list[int]]) -> list[torch.Tensor]:
    """Log-probs of each pair's option tokens after its unconditional prompt (``prefixes[i]`` then
    ``option_ids[i]``), every distinct sequence once, in ONE forward."""
    seqs = list(dict.fromkeys(tuple(p) + tuple(o) for p, o in zip(prefixes, option_ids)))
    width = max(len(s) for s in seqs)
    pad = model.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(s)) + list(s) for s in seqs], device=model.device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=model.device)
    logits, _ = model.forward(ids, mask, positions(mask), None, logits="all")
    logprobs = torch.log_softmax(logits, -1)
    row = {s: i for i, s in enumerate(seqs)}
    out = []
    for p, o in zip(prefixes, option_ids):
        i, n = row[tuple(p) + tuple(o)], len(o)
        cols = torch.arange(width - n, width, device=ids.device)
        out.append(logprobs[i, cols - 1, ids[i, cols]])
    return out
