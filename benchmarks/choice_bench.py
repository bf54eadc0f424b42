"""Benchmark B18b: choice scoring, one list call vs one call per row (HellaSwag shape, prefix cache on).

32 rows (8 in quick mode): a shared ~455-token few-shot prefix, a short question each, then a choice
among 4 endings (12-20 tokens) with ``method="exact"`` and a greedy sampler. The model's prefix
cache is on, so every call computes only its question and the options. Baseline: the 32 rows as 32
single calls; candidate: the same rows as ONE list call. Target: the list call no slower than the
singles (figure = singles' time / list call's time >= 1).

Choice scoring runs every option of a row in one row after its context (a token tree), so a list
call holds ``rows x (context + options)`` KV columns in its forward, not ``rows x options x context``.
Also reported: the peak KV bytes held by a forward of each side (its input cache plus the cache it
returns, shared storage counted once) against the KV bytes of the rows' own contexts, and whether
both sides chose the same endings with the same weights.
"""

from __future__ import annotations

import torch

from continuum import continuous, generate, models, samplers

from .counting import KVPeak
from .measurement import median, paired
from .model import Bench, make_text, n_tokens
from .results import Row, log, row_from_calls

__all__ = ["b18b"]

_ENDINGS = [" and then she walked back to the harbour before the rain came down.",
            " but nobody in the town ever saw the ship again, not even the harbour master.",
            " so the children ran home to tell their parents about the grey sails.",
            " while the baker, who had forgotten his ovens, burnt every loaf of bread that morning."]


def _kv_per_token(state) -> int:
    """KV bytes of one token of one row (every layer's keys and values), read from ``state.kv_cache``."""
    return sum(t[0, :, 0].numel() * t.element_size() for layer in state.kv_cache.layers for t in (layer.keys, layer.values))


def b18b(bench: Bench, cfg) -> list[Row]:
    count = getattr(cfg, "b18b_rows", 8 if cfg.quick else 32)
    reps = 1 if cfg.quick else cfg.heavy_reps  # heavy: 3 by default, --reps overrides
    tok = bench.tok
    prefix = make_text(tok, getattr(cfg, "b18b_prefix", 455), offset=11)
    prompts = [f"{prefix}\n\nQuestion {i + 1}: {make_text(tok, 12, offset=200 + 41 * i)}\nEnding:" for i in range(count)]
    cached = models.Transformers(bench.hf, bench.model.tokenizer, prefix_cache="256MiB")  # type: ignore[attr-defined]
    gen = generate.choice(cached, _ENDINGS, samplers.greedy())
    cont = continuous(gen)
    gen(prefix + "\n\nwarm-up")  # the prefix blocks are cached before anything is measured

    def singles():
        return {"values": [gen(p) for p in prompts]}

    def listed():
        return {"values": gen(prompts)}

    plen, lens = n_tokens(tok, prefix), [n_tokens(tok, p) for p in prompts]
    opt = [len(cached.tokenizer.encode_continuation(e)) for e in _ENDINGS]
    log(f"B18b: {count} rows behind one {plen}-token prefix ({min(lens)}-{max(lens)} tokens), 4 endings of {opt} tokens, "
        f"prefix cache on; {reps} paired reps")
    base, cand = paired(bench, singles, listed, reps, log=log)
    same = all(b.extra["values"] == c.extra["values"] for b, c in zip(base, cand))
    one, many = cont(prompts[0]), cont(prompts)
    weights_close = bool(torch.allclose(one.weights[0], many.weights[0], atol=1e-4, rtol=0))
    with KVPeak(bench.hf) as p1:
        cont(prompts[0])
    with KVPeak(bench.hf) as pn:
        state = cont(prompts)
    context = _kv_per_token(state) * sum(lens) if state.kv_cache is not None else 0
    notes = [(f"peak KV bytes of a forward: list call {pn.peak / 2**20:.0f} MiB, one single call {p1.peak / 2**20:.1f} MiB; "
              f"the {count} rows' own tokens take {context / 2**20:.0f} MiB of KV (list call / rows' KV = "
              f"{pn.peak / max(context, 1):.2f}; replicating each context per option would be >= {len(_ENDINGS)}x)"),
             f"same endings chosen by both sides: {same}; row 0's weight alone vs in the list within 1e-4: {weights_close}",
             f"list call median {median([c.seconds for c in cand]):.2f} s, singles {median([b.seconds for b in base]):.2f} s"]
    row = row_from_calls("B18b", f"choice scoring: list call vs singles ({count} rows x 4 endings, {plen}-token prefix)",
                         f"{count} single calls, prefix cache on", base, cand, op=">=", threshold=1.0, speedup=True,
                         notes=notes)
    if not (same and weights_close):
        row.figure = float("nan")
    return [row]
