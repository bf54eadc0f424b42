"""Forwards of hybrid and recurrent models (LFM2, Mamba) on transformers, over :class:`~.recurrent.HybridKV`.

A recurrent layer cannot mask a column out the way attention does: transformers zeroes a padding token's input,
which is exact only before a row's first token (the state starts at zero), never after it (a zero shifts the
convolution's window and decays an SSM state). So a forward here never feeds a masked column: the rows are grouped
by the pattern of real tokens in their new columns (one group in the usual case: a decoding step, samples of one
prompt), and each group runs on its real columns only; the attention KV gets zeros (masked) at the columns it
skipped, so the layout stays column for column the state's. Rows of different padding therefore run in separate
forwards (the same positions computed, more calls), and the engine runs each call's forward alone (no merged slabs:
:func:`continuum.models.hf.step.run_requests`).

Families (:data:`SUPPORTED`): LFM2, Mamba-2, Granite 4 (granitemoehybrid), Qwen3-Next and Falcon-H1 continue a
state over many tokens in one forward; Mamba's and Jamba's forwards ignore the SSM state they are given when they
run more than one token (their scan starts from zero), so such a row with a summary is continued one token per
forward (exact; a prompt from scratch is still one forward). Other families are refused at load with
:class:`~continuum.errors.RecurrentStateError`.

Example:
    >>> model = models.transformers("../shared/fixtures/models/lfm2-tiny")            # doctest: +SKIP
    >>> model.hybrid.model_type, model.hybrid.chunked                                 # doctest: +SKIP
    ('lfm2', True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import RecurrentStateError
from . import cache as _hf
from . import dynamic
from .hybrid_tree import TreeKV, tree_forward
from .recurrent import HybridKV, Snapshot, States

__all__ = ["HybridSpec", "SUPPORTED", "spec_of", "forward", "save_kv", "load_kv"]

# model_type -> whether one forward may continue a recurrent summary over several tokens (see the module docstring).
# Each family is checked by tests/test_hybrid.py on a tiny random model. Refused: zamba2 and nemotron_h, whose
# one-token decode step in transformers 5.24 disagrees with their full forward (3e-2 and 7e-3 on tiny models).
SUPPORTED = {"lfm2": True, "mamba": False, "mamba2": True, "granitemoehybrid": True, "qwen3_next": True,
             "jamba": False, "falcon_h1": True}


@dataclass(frozen=True)
class HybridSpec:
    """Which layers of a model are attention (``attn``) and which recurrent (``rec``), by index; ``chunked``: see
    :data:`SUPPORTED`."""

    model_type: str
    attn: tuple[int, ...]
    rec: tuple[int, ...]
    chunked: bool


def spec_of(config: Any, prefix_cache: Any = None) -> HybridSpec | None:
    """The model's :class:`HybridSpec`, None for a model without recurrent layers.

    Raises:
        RecurrentStateError: recurrent layers of a family continuum does not support yet (the message names them;
            sliding-window attention beside recurrent layers is one), or with a ``prefix_cache`` budget.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import (
        DynamicLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionCacheLayerMixin,
        LinearAttentionLayer,
    )

    layers = DynamicCache(config=config).layers
    rec = tuple(i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin))
    if not rec:
        return None
    kind = getattr(config, "model_type", "?")
    # a layer may hold both (Falcon-H1: attention and Mamba side by side): it is in both lists
    attn = tuple(i for i, layer in enumerate(layers) if isinstance(layer, DynamicLayer))
    known = (DynamicLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer)
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) not in known})
    if any(getattr(layers[i], "number_of_states", 1) != 1 for i in rec):  # (one conv + one SSM state per layer here)
        odd.append("several states in one layer")
    if kind not in SUPPORTED or odd:
        raise RecurrentStateError(
            f"{kind!r} has recurrent layers (layer types {sorted({type(x).__name__ for x in layers})}); continuum "
            f"supports the recurrent families {sorted(SUPPORTED)} on transformers so far (docs/hybrid.md). Use one "
            f"of those, or an attention-only model")
    if prefix_cache:
        raise RecurrentStateError(f"{kind!r} has recurrent layers: drop prefix_cache= (the prefix cache holds attention "
                                  f"KV only; a state keeps its own recurrent snapshots, docs/hybrid.md)")
    return HybridSpec(kind, attn, rec, SUPPORTED[kind])


def _cache(model: Any, spec: HybridSpec, kv: HybridKV | None, reserve: int):
    """A fresh ``DynamicCache`` over ``kv``: attention layers append into new storage (``cache.py``'s layers), the
    recurrent layers start from copies of the summary (transformers updates them in place)."""
    from transformers import DynamicCache

    cache: Any = DynamicCache(config=model.config)  # (its layers' union type has no conv_states: spec_of checked)
    attn = dynamic.append_layers(kv.attn if kv is not None and kv.attn else None, len(spec.attn), reserve)
    for i, append in zip(spec.attn, attn):
        if i not in spec.rec:
            cache.layers[i] = append
        elif append.keys is not None:  # a layer of both kinds keeps its class; its update concatenates (a copy)
            layer = cache.layers[i]
            layer.keys, layer.values, layer.dtype, layer.device = append.keys, append.values, append.dtype, append.device
            layer.is_initialized = True
    if kv is not None:
        for i, states in zip(spec.rec, kv.states()):
            layer = cache.layers[i]  # a LinearAttentionLayer (spec_of checked)
            layer.device, layer.dtype = states[0].device, states[0].dtype
            layer.conv_states[0], layer.conv_kernel_size[0] = states[0].clone(), states[0].shape[-1]
            layer.is_conv_states_initialized[0] = layer.has_previous_state[0] = True
            if len(states) > 1:
                layer.recurrent_states[0], layer.is_recurrent_states_initialized[0] = states[1].clone(), True
    return cache


def _read(cache, spec: HybridSpec) -> tuple[_hf.KV, States]:
    attn = tuple((cache.layers[i].keys, cache.layers[i].values) for i in spec.attn)
    states = tuple((cache.layers[i].conv_states[0],) + ((cache.layers[i].recurrent_states[0],)
                   if cache.layers[i].is_recurrent_states_initialized[0] else ()) for i in spec.rec)
    return attn, states


def _run_group(adapter: Any, spec: HybridSpec, ids, mask, pos, kv: HybridKV | None, logits: str, reserve: int):
    """One group's real columns on its KV: ``(logits, attention KV over cached + new, states)``; Mamba-like models
    run one token per forward once a row has a summary (see the module docstring)."""
    cache = _cache(adapter.model, spec, kv, reserve)
    C, k = mask.shape[1] - ids.shape[1], ids.shape[1]
    attn_mask = mask if spec.attn else None  # (Mamba multiplies its input by a 2-D mask of the new columns only)
    if spec.chunked or kv is None or k == 1 or not bool(kv.mask.any()):
        out = adapter._run(ids, attn_mask, pos, cache, logits)
    else:
        parts = [adapter._run(ids[:, j:j + 1], mask[:, :C + j + 1] if spec.attn else None, pos[:, j:j + 1], cache,
                              "all" if logits == "all" else "last") for j in range(k)]
        out = torch.cat(parts, 1) if logits == "all" else parts[-1]
    attn, states = _read(cache, spec)
    return out, attn, states


def forward(adapter: Any, spec: HybridSpec, input_ids, attention_mask, position_ids, kv: HybridKV | None, *,
            logits: str = "last", reserve: int = 0, allowed=None) -> tuple[torch.Tensor | None, HybridKV | TreeKV]:
    """:meth:`Transformers.forward_now <continuum.models.hf.Transformers.forward_now>` on a hybrid model: the same
    contract (logits of the new columns, a KV over all columns; ``kv`` unchanged), rows grouped by the pattern of
    their new columns' real tokens, each group on those tokens only (see the module docstring); a token tree
    (``allowed``) level by level (:mod:`continuum.models.hf.hybrid_tree`)."""
    R, N = input_ids.shape
    C = attention_mask.shape[1] - N
    if (kv.length() if kv is not None else 0) != C:
        raise ValueError(f"the attention mask covers {C} cached columns, the KV {kv.length() if kv else 0}")
    if kv is not None and not torch.equal(kv.mask, attention_mask[:, :C].bool().to(kv.mask.device)):
        raise RecurrentStateError(
            "the attention mask masks out cached tokens that the recurrent state already summarizes (a recurrent "
            "layer cannot forget a token): slice the state instead (state[..., :n] goes back to a snapshot and "
            "recomputes the rest); speculative decoding is not supported on recurrent models")
    if allowed is not None:  # choice scoring's token tree: level by level (hybrid_tree.py)
        def level(ids, mask, pos, sub):
            return _run_group(adapter, spec, ids, mask, pos, sub, "last", 0)

        return tree_forward(adapter, spec, level, input_ids, attention_mask, position_ids, kv, allowed, logits)
    new = attention_mask[:, C:].bool()
    patterns, which = torch.unique(new.cpu(), dim=0, return_inverse=True)
    idle = None
    if kv is not None and len(patterns) == 2 and not bool(patterns[0].any()):
        # Rows fed only pads (finished rows of a running call) beside one busy group: they run WITH it, so the step
        # stays one forward appending in place; their new columns stay masked in the KV, and their summaries are
        # put back after the forward (a recurrent layer must not consume a pad). Their logits are not read.
        idle = (which == 0).nonzero().flatten()
        patterns, which = patterns[1:], torch.zeros_like(which)
    vocab = adapter.vocab_size
    shape = {"last": (R, vocab), "all": (R, N, vocab)}.get(logits)
    out = None if shape is None else torch.zeros(shape, device=input_ids.device)
    attn_parts, state_parts = [], []
    for g, pattern in enumerate(patterns):
        rows = (which == g).nonzero().flatten()
        cols = pattern.nonzero().flatten()
        sub = kv.select_rows(rows) if kv is not None and len(patterns) > 1 else kv
        if cols.numel() == 0:  # nothing real to add (a finished row fed a pad): its summary stays
            attn_parts.append((rows, cols, sub.attn if sub is not None else None))
            state_parts.append((rows, sub.states() if sub is not None else None))
            continue
        dev_rows, dev_cols = rows.to(input_ids.device), cols.to(input_ids.device)
        ids, pos = input_ids[dev_rows][:, dev_cols], position_ids[dev_rows][:, dev_cols]
        mask = torch.cat([attention_mask[dev_rows, :C], torch.ones_like(ids, dtype=attention_mask.dtype)], 1)
        lg, attn, states = _run_group(adapter, spec, ids, mask, pos, sub, logits, reserve)
        if idle is not None and kv is not None:  # (see above: the idle rows' summaries put back)
            before = kv.select_rows(idle).states()
            states = tuple(tuple(t.index_copy(0, idle.to(t.device), b) for t, b in zip(layer, old))
                           for layer, old in zip(states, before))
        with adapter._count_lock:
            adapter.tokens_computed += (ids.shape[0] - (idle.numel() if idle is not None else 0)) * ids.shape[1]
        if out is not None:
            if logits == "all":
                out[dev_rows[:, None], dev_cols[None, :]] = lg
            else:
                out[dev_rows] = lg[:, -1]
        attn_parts.append((rows, cols, attn))
        state_parts.append((rows, states))
    attn = _assemble_attn(attn_parts, R, C, N, spec)
    states = _assemble_states(state_parts, R, adapter, spec)
    mask = attention_mask.bool()
    # The first forward of a call (on nothing, or on a state a call or a slice settled) prefills its prompt: the
    # summary at the prompt's end is kept like a call's end (regenerating a reply, a chat re-rendering it, go back there)
    start = kv is None or kv.settled
    if kv is None:
        return out, HybridKV(attn, mask, Snapshot(C + N, states, end=True))
    return out, kv.advanced(attn, mask, states, end=start, interval=getattr(adapter, "snapshot_interval", None))


def _assemble_attn(parts, R: int, C: int, N: int, spec: HybridSpec) -> _hf.KV:
    """The groups' attention KV as one over all rows and ``C + N`` columns (zeros where a group skipped a masked
    column: masked, never attended to; zeros because 0 x NaN is NaN in attention)."""
    if not spec.attn:
        return ()
    if len(parts) == 1 and parts[0][1].numel() == N and parts[0][2] is not None:
        return parts[0][2]  # the usual case: every row, every column (the storage appends in place next time)
    like = next((a for _, _, a in parts if a), None)
    if like is None:
        raise ValueError("a forward with no real token and no KV: there is nothing to compute (a state holds a real "
                         "token in every row)")
    out = []
    for layer in range(len(spec.attn)):
        k0 = like[layer][0]
        K = k0.new_zeros((R, k0.shape[1], C + N, k0.shape[3]))
        V = torch.zeros_like(K)
        for rows, cols, attn in parts:
            if not attn:
                continue
            r = rows.to(K.device)
            at = torch.cat([torch.arange(C), cols + C]).to(K.device)
            K[r[:, None], :, at[None, :]] = attn[layer][0].transpose(1, 2)
            V[r[:, None], :, at[None, :]] = attn[layer][1].transpose(1, 2)
        out.append((K, V))
    return tuple(out)


def _assemble_states(parts, R: int, adapter: Any, spec: HybridSpec) -> States:
    if len(parts) == 1 and parts[0][1] is not None:
        return parts[0][1]
    like = next((s for _, s in parts if s is not None), None) or _zero_states(adapter, spec)
    out = []
    for i, layer in enumerate(like):
        tensors = []
        for j, t in enumerate(layer):
            full = t.new_zeros((R, *t.shape[1:]))
            for rows, states in parts:
                if states is not None:
                    full[rows.to(full.device)] = states[i][j]
            tensors.append(full)
        out.append(tuple(tensors))
    return tuple(out)


def _zero_states(adapter: Any, spec: HybridSpec) -> States:
    """One row of zero summaries (shapes learnt from a one-token forward, once): rows that never saw a token."""
    zero = adapter.__dict__.get("_zero_states")
    if zero is None:
        cache = _cache(adapter.model, spec, None, 0)
        one = torch.ones((1, 1), dtype=torch.long, device=adapter.device)
        with torch.inference_mode():
            adapter.model(input_ids=one, position_ids=one - 1, **dynamic.cache_kwargs(adapter.model, cache), use_cache=True)
        zero = adapter.__dict__["_zero_states"] = tuple(tuple(torch.zeros_like(t) for t in s) for s in _read(cache, spec)[1])
    return zero


def save_kv(kv: HybridKV) -> tuple[dict[str, torch.Tensor], dict]:
    """A hybrid KV as tensors and metadata for a state file (the attention KV and the current summary; earlier
    snapshots are not written: a loaded state slices back by recomputing)."""
    tensors = {"hyb_mask": kv.mask}
    for i, (k, v) in enumerate(kv.attn):
        tensors[f"hyb_k{i}"], tensors[f"hyb_v{i}"] = k, v
    shapes = []
    for i, layer in enumerate(kv.states()):
        shapes.append(len(layer))
        for j, t in enumerate(layer):
            tensors[f"hyb_s{i}_{j}"] = t
    return tensors, {"backend": "transformers-hybrid", "attn": len(kv.attn), "states": shapes}


def load_kv(tensors: dict[str, torch.Tensor], meta: dict, device: torch.device) -> HybridKV:
    """The :class:`HybridKV` :func:`save_kv` wrote, on ``device``."""
    if meta.get("backend") != "transformers-hybrid":
        raise RecurrentStateError(f"the file's KV was written by {meta.get('backend')!r}, not a transformers hybrid model")
    on = {k: t.to(device) for k, t in tensors.items() if k.startswith("hyb_")}
    attn = tuple((on[f"hyb_k{i}"], on[f"hyb_v{i}"]) for i in range(meta["attn"]))
    states = tuple(tuple(on[f"hyb_s{i}_{j}"] for j in range(n)) for i, n in enumerate(meta["states"]))
    mask = on["hyb_mask"].bool()
    return HybridKV(attn, mask, Snapshot(int(mask.shape[1]), states, end=True), settled=True)
