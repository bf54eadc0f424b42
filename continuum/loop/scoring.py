"""Exact choice: score every option in context with ONE forward pass, then let the sampler pick.

Options are tokenized as ``state + option`` would tokenize them. All options of a row run in ONE row
after its context: a token tree (:mod:`continuum.models.token_tree`) whose trunk is the row's uncached
suffix (``state + " Answer:"``'s new text: computed in the same forward, not a prefill before it),
options sharing a prefix sharing its nodes, each node attending to the row's context and its own
ancestors only, at the positions it would have alone. A suffix longer than :data:`TRUNK` columns, the
prefix cache (which may hold it), classifier-free guidance and hybrid models (whose trees run level by
level) take the usual prefill first (every column but each row's last token cached), the tree rooted at
that last token. Every row of the batch is in the same forward, which holds ``context + tree`` KV columns
per row (never ``options x context``). An option's score is the sum of the model's log-probs of its
tokens (``method="exact"``; no end-of-option term, so an option that is a prefix of another scores at
least as high) or their mean (``method="mean"``).

The scores form a ``(rows, options)`` matrix that the usual samplers consume as if options were
a vocabulary: greedy takes the best, multinomial(n) draws n, beam_search(n) keeps the n best
(row, option) pairs. Each chosen pair gets a cache of its own, new storage gathered from the row's
context columns and its option's tree columns (:func:`~continuum.models.kv.gather_paths`: new storage on
transformers, views of the option's own sequence on llama.cpp); nothing another state can see is written.

A backend whose trees have bounds (llama.cpp: a leaf takes one of its 255 sequence ids, a node one of its cells) may
not hold every option path of every row at once (a choice among 1,000 numbers, 40 options under beam_search(8), 60
options of 6 tokens on a 256-cell pool). Then the rows are
prefilled to their last token and scored in parts, as many rows and options as fit in each part's tree, each part's
KV dropped as it is read. The chosen pairs' states hold their rows' cached context; their last token and option
tokens are left uncached, for the call that continues them to compute (once, in its one forward). Each part
computes its rows' last tokens again (one a row); nothing is refused that fits in memory.

With classifier-free guidance, each option token's score is the guided log-prob
(:func:`~continuum.loop.cfg.guided_logprobs` of the conditional log-prob and the log-prob after the
row's unconditional prompt, one more forward over every distinct (unconditional prompt, option)
pair, the negative prompt once per option: no row context is replicated there, so it keeps that
path); the sampler ranks by the summed (or mean) guided scores, the weights stay the raw ones.

With ``token_healing``, a row whose last token can be healed loses it, and each option is scored
as the removed text followed by the option, tokenized together (the first token may re-cover the
removed text and the option's start): the option's score includes re-covering that text.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from ..errors import ContextLengthError
from ..models import kv as kvcache
from ..models import token_tree
from ..models.kv import positions
from ..samplers import Sampler
from ..state import LastStep, SequenceState
from ..state.combine import first_text, no_text
from .arrivals import GATE
from .cancel import check_cancelled
from .cfg import Guidance, guided_logprobs
from .decoding import Step, check_continuable, prefill
from .parallel import check_seeded
from .setup import recompute_stale
from .turns import choice_prompts, in_parts

__all__ = ["choose", "TRUNK"]

TRUNK = 64  # the longest uncached suffix scored as the trees' trunk (longer: a prefill first, chunked beside others)


def choose(state: SequenceState, options: Sequence[str], sampler: Sampler, *, method: str = "exact",
           rng: torch.Generator | None = None, guidance: Guidance | None = None,
           token_healing: bool = False) -> Generator[Step, None, SequenceState]:
    """Pick one option per output row; yields one :class:`Step`, returns the new state. More prompts than the backend
    scores at once (sequence ids, cells, the engine's ``max_rows``) are scored in parts at once, like list calls."""
    k = choice_prompts(state, [len(state._model.tokenizer.encode_continuation(o)) for o in options])
    if k is not None:
        def part(p: SequenceState, opts: dict) -> Generator[Step, None, SequenceState]:
            return choose(p, options, sampler, method=method, rng=opts["rng"], guidance=guidance,
                          token_healing=token_healing)

        result = in_parts(part, state, k, {"rng": rng})
        starts = result._last.starts if result._last is not None else (0,) * result.rows  # (stack keeps every part's)
        yield Step([t[s:] for t, s in zip(result.texts, starts)], True)
        return result
    with GATE.held():  # (few callers' bookkeeping at once: the engine's steps are not starved of the GIL)
        result, step = _choose(state, options, sampler, method, rng, guidance, token_healing)
    yield step
    return result


def _choose(state: SequenceState, options: Sequence[str], sampler: Sampler, method: str, rng: torch.Generator | None,
            guidance: Guidance | None, token_healing: bool) -> tuple[SequenceState, Step]:
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
    model, tok = state._model, state._model.tokenizer
    K, R = len(options), state.rows
    encoded = {x: [tok.encode_continuation(x + o) for o in options] for x in set(removed)}
    row_options = [encoded[x] for x in removed]
    for r, (real, _) in enumerate(state._real_rows()):  # a row with no text yet (BOS only): as state + option reads it
        if not removed[r] and no_text(tok, real):
            row_options[r] = [first_text(tok, real, e, o) if e else e for e, o in zip(row_options[r], options)]
    option_ids = [row_options[i // K][i % K] for i in range(R * K)]  # per (row, option) pair
    longest, ctx = int(state._mask.sum(1).max()), model.context_length
    if ctx is not None and longest + max(map(len, option_ids)) > ctx:  # every option is scored in full
        raise ContextLengthError(f"the input ({longest} tokens) leaves no room for the longest option "
                                 f"({max(map(len, option_ids))} tokens) in the model's context ({ctx}): "
                                 f"shorten the input, e.g. state[..., -N:] keeps its last N characters")
    state = recompute_stale(state)
    C, W = kvcache.length(state._kv), state._ids.shape[1]
    bounds = _tree_bounds(model)
    apart = _too_wide(state, bounds, row_options)  # more option paths than sequence ids, or nodes than cells
    # (a hybrid's tree runs level by level on transformers: a trunk there would be a forward per token)
    if guidance is not None or getattr(model, "prefix_cache", None) is not None or getattr(model, "hybrid", None) \
            or W - C > TRUNK or apart:
        # the shared suffix first, leaving room for the tree so its forward appends in place
        state = prefill(state, reserve=1 + max(sum(map(len, opts)) for opts in encoded.values()))
        C = kvcache.length(state._kv)  # every column but the last (each row's root) is cached

    # the uncached suffix and every option of a row in ONE row after its context: a token tree on its cache
    new = state._mask[:, C:].bool()
    suffix = [state._ids[r, C:][new[r]].tolist() for r in range(R)]  # root, then trunk
    if apart:
        pair_lps = _scores_in_parts(state, C, suffix, row_options, bounds, longest)
    else:
        tree, kv, pair_lps = _tree_forward(state, C, suffix, row_options)  # per (row, option) pair, row-major
    lengths = torch.tensor([len(ids) for ids in option_ids])
    gain = torch.stack([lp.sum() for lp in pair_lps]).cpu() if pair_lps else torch.zeros(0)  # raw log-prob of each option
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
    order = list(range(chosen.numel()))
    if sampler.is_beam_search:  # best first, by the score the search ranked with
        n = sampler.samples
        order = [b * n + i for b in range(state.batch) for i in sorted(range(n), key=lambda i: -float(ranked[b * n + i]))]
    pick = torch.tensor(order)
    weights, ancestors, ids = weights.index_select(0, pick), ancestors.index_select(0, pick), ids.index_select(0, pick)
    if apart:
        out = _chosen_apart(state, C, suffix, row_options, ancestors.tolist(), ids.tolist(), pair_lps, K)
    else:
        out = _chosen_state(state, tree, kv, ancestors.tolist(), ids.tolist(), pair_lps, K)
    texts = out.texts
    last = LastStep(kind="choice", starts=tuple(starts[a] for a in ancestors.tolist()), ends=tuple(len(t) for t in texts),
                    complete=(True,) * out.rows, finish=("pattern",) * out.rows)
    result = SequenceState(model=model, ids=out._ids, mask=out._mask, logprobs=out._logprobs, weights=weights,
                           kv=out._kv, batch=state.batch, samples=sampler.samples, last=last)
    return result, Step([t[s:] for t, s in zip(texts, last.starts)], True)


def _tree_forward(state: SequenceState, C: int, suffix: list[list[int]], row_options: list[list[list[int]]]
                  ) -> tuple[token_tree.TokenTree, kvcache.KV, list[torch.Tensor]]:
    """ONE forward of every row's tree (its root and trunk, then the trie of its options) on the row's cached
    context: the tree, its KV and each (row, option) pair's log-probs, row-major."""
    tree = token_tree.build([s[0] for s in suffix], state._mask[:, :C].sum(1).tolist(), row_options,
                            state._mask[:, :C], state._model.tokenizer.pad_token_id, trunks=[s[1:] for s in suffix])
    logits, kv = state._model.forward(tree.ids, torch.cat([state._mask[:, :C], tree.real], 1), tree.positions,
                                      state._kv, logits="outputs", allowed=tree.allowed, outputs=tree.outputs)
    return tree, kv, tree.option_logprobs(logits)


def _rows(state: SequenceState, rows: list[int]) -> SequenceState:
    """Rows ``rows`` of ``state`` as a state of one sample each (their cache: views, nothing copied)."""
    idx = torch.tensor(rows, dtype=torch.long, device=state._ids.device)
    return SequenceState(model=state._model, ids=state._ids.index_select(0, idx), mask=state._mask.index_select(0, idx),
                         logprobs=state._logprobs.index_select(0, idx), weights=torch.zeros(len(rows)),
                         kv=kvcache.select_rows(state._kv, idx), batch=len(rows), samples=1)


def _tree_bounds(model) -> tuple[int | None, int | None]:
    """What one token-tree forward may hold: sequence ids (llama.cpp: the rows' own and one per leaf) and cells (the
    rows' contexts and every node); None where the backend has no such bound (transformers)."""
    measure = getattr(model, "capacity", None)
    cap = measure([]) if measure is not None else None
    return getattr(model, "max_call_rows", None), (cap.total if cap is not None else None)


def _nodes(options: list[list[int]]) -> int:
    """A trie's nodes: the options' distinct token prefixes."""
    return len({tuple(o[:i + 1]) for o in options for i in range(len(o))})


def _too_wide(state: SequenceState, bounds: tuple[int | None, int | None], row_options: list[list[list[int]]]) -> bool:
    """Whether one tree of every row's options exceeds :func:`_tree_bounds`: its rows' own sequences and one per
    leaf, or its rows' cells (what their cache holds together, a fork's shared prefix once, and every uncached
    token) and its nodes."""
    ids, cells = bounds
    R, K = len(row_options), len(row_options[0])
    if ids is not None and ids < R * (1 + K):
        return True
    if cells is None:
        return False
    seen: dict[int, int] = {}  # (rows of one tokenization share the list: its trie counted once)
    nodes = sum(seen.setdefault(id(opts), _nodes(opts)) for opts in row_options)
    together, C = getattr(state._model, "rows_cells", None), kvcache.length(state._kv)
    held = together(state._kv, list(range(R))) if together is not None and state._kv is not None else 0
    return cells < held + int(state._mask[:, C:].sum()) + nodes


def _scores_in_parts(state: SequenceState, C: int, suffix: list[list[int]], row_options: list[list[list[int]]],
                     bounds: tuple[int | None, int | None], longest: int) -> list[torch.Tensor]:
    """Each (row, option) pair's log-probs, row-major, when one tree of all would not fit the backend's bounds
    (:func:`_tree_bounds`): trees of as many rows and options as fit, one forward each, their KV dropped at once
    (:func:`_chosen_apart`). Every row is prefilled to its last token first, so a part computes only its roots (one
    token a row) and its options' nodes."""
    R, K = len(row_options), len(row_options[0])
    ids, cells = bounds
    lengths = [max(len(opts[k]) for opts in row_options) for k in range(K)]  # (an option's tokens, at most, a row)
    # (a row takes its own sequence, one per leaf, and one more where its view is a short one of a long spilled
    # state: tree._fork_leaves restores only its positions into a sequence of its own)
    rows_at_once = max(1, min(R, ids // 3 if ids is not None else R,
                              cells // (2 * (longest + 1 + max(lengths))) if cells is not None else R))
    per = max(1, ids // rows_at_once - 2) if ids is not None else K  # options a row scores in one part
    room = cells - rows_at_once * (longest + 1) if cells is not None else None  # cells for a part's nodes
    groups: list[list[int]] = [[]]
    used = 0
    for k, n in enumerate(lengths):
        if groups[-1] and (len(groups[-1]) == per or (room is not None and used + rows_at_once * n > room)):
            groups.append([])
            used = 0
        groups[-1].append(k)
        used += rows_at_once * n
    out: list[torch.Tensor] = [torch.empty(0)] * (R * K)
    for r0 in range(0, R, rows_at_once):
        rows = list(range(r0, min(R, r0 + rows_at_once)))
        part = _rows(state, rows)
        for ks in groups:
            _, kv, lps = _tree_forward(part, C, [suffix[r] for r in rows], [[row_options[r][k] for k in ks] for r in rows])
            del kv  # (its leaves released: the next part takes their ids, its nodes their cells)
            for (r, k), lp in zip(((r, k) for r in rows for k in ks), lps):
                out[r * K + k] = lp
    return out


def _chosen_apart(state: SequenceState, C: int, suffix: list[list[int]], row_options: list[list[list[int]]],
                  rows: list[int], picks: list[int], pair_lps: list[torch.Tensor], K: int) -> SequenceState:
    """The chosen pairs after :func:`_scores_in_parts`, one row each: the row's cached context (views of its cache,
    nothing copied), then its root, trunk and option's tokens, uncached (the parts' KV is gone: the call that continues
    the state computes them, in its one forward); shorter tails get holes before them."""
    dev = state._ids.device
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    tails = [suffix[r] + row_options[r][k] for r, k in zip(rows, picks)]
    M = max(map(len, tails))
    pad = state._model.tokenizer.pad_token_id
    tail = torch.tensor([[pad] * (M - len(t)) + t for t in tails], dtype=torch.long, device=dev)
    real = torch.tensor([[0] * (M - len(t)) + [1] * len(t) for t in tails], dtype=state._mask.dtype, device=dev)
    lp = torch.full((len(rows), M), float("nan"), dtype=state._logprobs.dtype, device=dev)
    for j, (r, k) in enumerate(zip(rows, picks)):
        own = state._logprobs[r, C:][state._mask[r, C:].bool()]  # the root and trunk keep their own log-probs
        lp[j, M - len(tails[j]):] = torch.cat([own, pair_lps[r * K + k].to(lp)])
    return SequenceState(model=state._model, ids=torch.cat([state._ids[:, :C].index_select(0, idx), tail], 1),
                         mask=torch.cat([state._mask[:, :C].index_select(0, idx), real], 1),
                         logprobs=torch.cat([state._logprobs[:, :C].index_select(0, idx), lp], 1),
                         weights=torch.zeros(len(rows)), kv=kvcache.select_rows(state._kv, idx), batch=len(rows),
                         samples=1)


def _chosen_state(state: SequenceState, tree: token_tree.TokenTree, kv: kvcache.KV, rows: list[int], picks: list[int],
                  pair_lps: list[torch.Tensor], K: int) -> SequenceState:
    """One row per chosen (row, option) pair: the row's context, its root and trunk (its uncached suffix), then
    the option's tokens (the last one uncached). Its cache is new storage holding the row's context columns and
    the path's own tree columns only (``kv``, the tree forward's cache, is only read); rows whose paths are
    shorter than the longest chosen one get holes before their root."""
    C = kvcache.length(state._kv)
    dev = state._ids.device
    paths = [[0] + tree.trunks[r] + tree.paths[r][k] for r, k in zip(rows, picks)]  # tree nodes, root first
    M = max(map(len, paths))
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    used = state._mask[:, :C].index_select(0, idx).bool().any(0)
    lead = int(used.long().argmax()) if bool(used.any()) else C  # leading padding of every chosen row: dropped
    J = len(rows)
    node = torch.tensor([[0] * (M - len(p)) + p for p in paths], dtype=torch.long, device=dev)  # holes: the root
    hole = torch.tensor([[1] * (M - len(p)) + [0] * len(p) for p in paths], dtype=torch.bool, device=dev)
    ids = torch.cat([state._ids[:, lead:C].index_select(0, idx), tree.ids.index_select(0, idx).gather(1, node)], 1)
    ids[:, C - lead:].masked_fill_(hole, state._model.tokenizer.pad_token_id)
    mask = torch.cat([state._mask[:, lead:C].index_select(0, idx), (~hole).to(state._mask.dtype)], 1)
    lp = torch.full((J, M), float("nan"), dtype=state._logprobs.dtype, device=dev)
    for j, (r, k, p) in enumerate(zip(rows, picks, paths)):
        own = state._logprobs[r, C:][state._mask[r, C:].bool()]  # the root and trunk keep their own log-probs
        lp[j, M - len(p):M - len(p) + len(own)] = own
        if len(p) > len(own):
            lp[j, M - len(p) + len(own):] = pair_lps[r * K + k].to(lp)
    logprobs = torch.cat([state._logprobs[:, lead:C].index_select(0, idx), lp], 1)
    cache = kvcache.gather_paths(kv, idx, lead, C, node[:, :-1], mask[:, :-1])
    return SequenceState(model=state._model, ids=ids, mask=mask, logprobs=logprobs, weights=torch.zeros(J),
                         kv=cache, batch=J, samples=1)


def _uncond_option_logprobs(model, prefixes: list[list[int]], option_ids: list[list[int]]) -> list[torch.Tensor]:
    """Log-probs of each pair's option tokens after its unconditional prompt (``prefixes[i]`` then
    ``option_ids[i]``), every distinct sequence once, in ONE forward (in as many as the backend's bounds ask:
    :func:`_tree_bounds`, a row a sequence id and its tokens' cells; 300 options on llama.cpp are 300 rows)."""
    seqs = list(dict.fromkeys(tuple(p) + tuple(o) for p, o in zip(prefixes, option_ids)))
    width = max(len(s) for s in seqs)
    ids_bound, cells = _tree_bounds(model)
    at_once = max(1, min(len(seqs), ids_bound - 1 if ids_bound is not None else len(seqs),
                         cells // width if cells is not None else len(seqs)))
    pad = model.tokenizer.pad_token_id
    found: dict[tuple, torch.Tensor] = {}
    for s0 in range(0, len(seqs), at_once):
        part = seqs[s0:s0 + at_once]
        ids = torch.tensor([[pad] * (width - len(s)) + list(s) for s in part], device=model.device)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in part], device=model.device)
        logits, _ = model.forward(ids, mask, positions(mask), None, logits="all")
        logprobs = torch.log_softmax(logits, -1)
        found.update(zip(part, logprobs))
    out = []
    for p, o in zip(prefixes, option_ids):
        seq, n = tuple(p) + tuple(o), len(o)
        cols = torch.arange(width - n, width, device=model.device)
        out.append(found[seq][cols - 1, torch.tensor(seq[len(seq) - n:], dtype=torch.long, device=model.device)])
    return out
