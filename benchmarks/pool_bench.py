"""B26: any load on a fixed KV pool (llama.cpp): throughput as programs are added, and the cost of a small pool.

The model: Gemma 3 270M Q4_K_M (registry package) when installed, else the stories260K f32 GGUF (noted); ``--smoke``
takes the fixture at toy size. Greedy text under ``run_batch``; tokens/s counts generated tokens.

* B26a: run_batch throughput at 1, 8, 32, 64, 128 programs (48 tokens each, a pool large enough for all): the
  figure is the throughput at the most programs over the best at fewer (>= 1.0: it never falls as programs are
  added). llama-server's own figures are measured outside this suite (it is a C++ build): see docs/benchmarks.md.
* B26b: 128 programs x 200 tokens on a 4,096-cell pool vs a pool large enough for all: tokens/s ratio (>= 0.9x),
  the calls parked and resumed, and the decodes per park ((parks + decodes that found no room) / parks), in the notes.
* B26f: 64 programs x a 3-call chain (text 40 tokens -> choice -> JSON 30 tokens) in the batch-invariant mode on a
  pool 4x too small vs a roomy one: throughput ratio (>= 0.8x); the programs whose tokens and weights equal the
  same program alone are counted in the notes (the mode's promise; see docs/scheduler.md for why not all do).
"""

from __future__ import annotations

import time

from .common import Bench, Row
from .llamacpp_bench import gguf_bench

__all__ = ["POOL_SCENARIOS"]

WORDS = ["cat", "dog", "bird", "king", "girl", "boy", "tree", "ship"]


def _prompts(n: int) -> list[str]:
    return [f"Write a short story about a {WORDS[i % len(WORDS)]} number {i}." for i in range(n)]


def _throughput(model, n: int, tokens: int) -> tuple[float, dict]:
    """Generated tokens per second of ``n`` greedy programs under run_batch (all at once), and the engine's stats."""
    from continuum import continuous, generate, run_batch, samplers

    gen = continuous(generate.text(model, samplers.greedy()))
    model.engine.reset_stats()
    t = time.perf_counter()
    out = run_batch(lambda p: gen(p, max_tokens=tokens), _prompts(n), concurrency=n)
    took = time.perf_counter() - t
    made = sum(int((~s.token_logprobs[0].isnan()).sum()) for s in out)
    return made / took, model.engine.stats()


def b26(bench: Bench, cfg) -> list[Row]:
    from continuum import models

    _, path, name, threads = gguf_bench(cfg)
    counts = [1, 2, 4] if cfg.smoke else [1, 8, 32, 64] if cfg.quick else [1, 8, 32, 64, 128]
    n_a = 4 if cfg.smoke else 48
    roomy_cells = 4096 if cfg.smoke else 16384
    big = models.llamacpp(path, n_threads=threads, n_ctx=roomy_cells)
    curve = [_throughput(big, n, n_a)[0] for n in counts]
    best_before = max(curve[:-1])
    rows = [Row("B26a", f"run_batch tokens/s at {counts[-1]} programs vs the best at fewer", "best at fewer programs",
                curve[-1] / best_before, ">=", 1.0, "x throughput",
                notes=[f"model: {name}; {n_a} greedy tokens a program, n_ctx {roomy_cells} (room for all)",
                       "tokens/s at " + ", ".join(f"{n}: {t:.0f}" for n, t in zip(counts, curve))],
                series={"title": "B26a: run_batch throughput", "x": counts, "xlabel": "programs",
                        "ylabel": "tokens/s", "lines": {"continuum": curve}})]

    n_b, tokens_b = (8, 8) if cfg.smoke else (64, 100) if cfg.quick else (128, 200)
    roomy_tps, _ = _throughput(big, n_b, tokens_b)
    big.llama.close()
    cells = 256 if cfg.smoke else 4096
    small = models.llamacpp(path, n_threads=threads, n_ctx=cells)
    small_tps, stats = _throughput(small, n_b, tokens_b)
    small.llama.close()
    per_park = (stats["parked"] + stats["no_room"]) / stats["parked"] if stats["parked"] else 1.0
    rows.append(Row("B26b", f"{n_b} programs x {tokens_b} tokens on a {cells}-cell pool",
                    "a pool large enough for all", small_tps / roomy_tps, ">=", 0.9, "x throughput",
                    base_tps=roomy_tps, cont_tps=small_tps,
                    notes=[f"model: {name}", f"{stats['parked']} parks, {stats['resumed']} resumes, {stats['no_room']} "
                           f"decodes that found no room ({per_park:.2f} decodes per park), none failed"]))
    rows.append(_b26f(cfg, path, name, threads))
    return rows


def _chain(model):
    """text -> choice -> JSON, the state carried from call to call (greedy everywhere: comparable to alone)."""
    from continuum import continuous, generate, samplers

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"]}
    text = continuous(generate.text(model, samplers.greedy()))
    pick = continuous(generate.choice(model, [" happy", " sad", " brave"]))
    card = continuous(generate.json(model, schema, samplers.greedy()))

    def program(p):
        s1 = text(p, max_tokens=40)
        return card(pick(s1 + " The hero was") + "\nAs JSON: ", max_tokens=30)

    return program


def _b26f(cfg, path, name, threads) -> Row:
    from continuum import models, run_batch

    n, small_cells, roomy_cells = (6, 512, 4096) if cfg.smoke else (64, 2048, 16384)
    prompts = _prompts(n)
    results, tps = {}, {}
    for cells in (roomy_cells, small_cells):
        model = models.llamacpp(path, n_threads=threads, n_ctx=cells, batch_invariant=True)
        model.engine.reset_stats()
        t = time.perf_counter()
        results[cells] = run_batch(_chain(model), prompts, concurrency=n)
        took = time.perf_counter() - t
        tps[cells] = sum(int((~s.token_logprobs[0].isnan()).sum()) for s in results[cells]) / took
        stats = model.engine.stats()
        model.llama.close()
    alone_model = models.llamacpp(path, n_threads=threads, n_ctx=roomy_cells, batch_invariant=True)
    alone = [_chain(alone_model)(p) for p in prompts[:8]]
    alone_model.llama.close()
    same_text = sum(str(a) == str(b) for a, b in zip(results[small_cells], alone))
    same_w = sum(bool((a.weights == b.weights).all()) for a, b in zip(results[small_cells], alone))
    return Row("B26f", f"{n} programs x text -> choice -> JSON, invariant mode, a {small_cells}-cell pool (4x too small)",
               f"a {roomy_cells}-cell pool", tps[small_cells] / tps[roomy_cells], ">=", 0.8, "x throughput",
               base_tps=tps[roomy_cells], cont_tps=tps[small_cells],
               notes=[f"model: {name}", f"{stats['parked']} parks, {stats['no_room']} decodes that found no room",
                      f"of the first {len(alone)} programs, {same_text} give the text and {same_w} the exact weights of "
                      "the program alone (the invariant mode under churn: docs/scheduler.md)"])


POOL_SCENARIOS = {"B26": b26}
