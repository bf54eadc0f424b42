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
  same program alone are counted in the notes (the mode's promise: 8 of 8 on Gemma since the choice's default is
  greedy, docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .llamacpp_bench import gguf_bench
from .model import Bench
from .results import Row

TILED_MM = "GGML_CPU_TILED_MM"

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
    pick = continuous(generate.choice(model, [" happy", " sad", " brave"], samplers.greedy()))
    card = continuous(generate.json(model, schema, samplers.greedy()))

    def program(p):
        s1 = text(p, max_tokens=40)
        return card(pick(s1 + " The hero was") + "\nAs JSON: ", max_tokens=30)

    return program


def _b26f(cfg, path, name, threads) -> Row:
    """Measured in a fresh process started with ``GGML_CPU_TILED_MM=0``: the invariant mode's exactness on K-quant
    weights needs the tiled matmul off before the process's first matmul, and B26a/b have decoded with it on."""
    env = {**os.environ, TILED_MM: "0"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.pool_bench", str(path), str(threads), str(int(cfg.smoke))],
                          env=env, capture_output=True, text=True, timeout=3600, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        raise RuntimeError(f"B26f's process failed: {proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return Row("B26f", f"{got['n']} programs x text -> choice -> JSON, invariant mode, a {got['small']}-cell pool "
               "(4x too small)", f"a {got['roomy']}-cell pool", got["small_tps"] / got["roomy_tps"], ">=", 0.8,
               "x throughput", base_tps=got["roomy_tps"], cont_tps=got["small_tps"],
               notes=[f"model: {name}; GGML_CPU_TILED_MM=0 (a fresh process)",
                      f"{got['parked']} parks, {got['no_room']} decodes that found no room",
                      f"of the first {got['compared']} programs, {got['same_text']} give the text and {got['same_weights']} "
                      "the exact weights of the program alone (the invariant mode under churn: docs/scheduler.md)"])


def _b26f_measure(path: str, threads: int, smoke: bool) -> dict:
    from continuum import models, run_batch

    n, small_cells, roomy_cells = (6, 512, 4096) if smoke else (64, 2048, 16384)
    prompts = _prompts(n)
    results, tps, stats = {}, {}, {}
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
    pairs = list(zip(results[small_cells], alone))
    return {"n": n, "small": small_cells, "roomy": roomy_cells, "small_tps": tps[small_cells],
            "roomy_tps": tps[roomy_cells], "parked": stats["parked"], "no_room": stats["no_room"], "compared": len(pairs),
            "same_text": sum(str(a) == str(b) for a, b in pairs),
            "same_weights": sum(bool((a.weights == b.weights).all()) for a, b in pairs)}


POOL_SCENARIOS = {"B26": b26}

if __name__ == "__main__":  # (B26f's own process: python -m benchmarks.pool_bench PATH THREADS SMOKE)
    print(json.dumps(_b26f_measure(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1")))
