"""B24h: what a user of ``run_batch`` gets on llama.cpp, per mode: each program's token log-probs merged vs alone
(the largest difference, and how many greedy texts differ), and the invariant mode's cost.

The invariant mode is measured in a process of its own, started with ``GGML_CPU_TILED_MM=0``: ggml reads that
setting once, at the process's first K-quant matmul, and the default mode measured here (and B24a-g before it)
has decoded with the tiled kernel on, which the invariant mode cannot then turn off (it warns).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .results import Row

__all__ = ["PROMPTS", "b24h"]

# (B24's prompts: every llama.cpp scenario's programs)
PROMPTS = ["Once upon a time", "The little dog", "One day, Lily", "Tom had a red ball", "The sun was hot",
           "A bird sang", "Mom said", "The cat sat"]


def measure(path: str, invariant: bool, smoke: bool) -> dict:
    """``run_batch`` of the prompts vs each alone in one mode, and one raw ``llama_decode`` of 4 prefills merged vs
    each alone (why the invariant mode gives each prefill its own decode)."""
    from continuum import continuous, generate, models, run_batch, samplers
    from continuum.models.llamacpp import DecodeRow, SequencePool, decode

    n = 4 if smoke else 16
    model = models.llamacpp(path, n_threads=2, batch_invariant=invariant)
    gen = continuous(generate.text(model, samplers.greedy()))
    alone = [gen(p, max_tokens=n) for p in PROMPTS]
    t = time.perf_counter()
    together = run_batch(lambda p: gen(p, max_tokens=n), PROMPTS)
    took = time.perf_counter() - t
    worst, differ = 0.0, 0
    for a, b in zip(alone, together):
        differ += str(a) != str(b)
        ta, tb = a.token_ids[0].tolist(), b.token_ids[0].tolist()
        la, lb = a.token_logprobs[0].tolist(), b.token_logprobs[0].tolist()
        for k in range(min(len(ta), len(tb))):  # the same tokens so far: their log-probs (NaN: prompt tokens)
            if ta[k] != tb[k]:
                break
            if la[k] == la[k] and lb[k] == lb[k]:
                worst = max(worst, abs(la[k] - lb[k]))
    pool, tok = SequencePool.of(model.llama), model.tokenizer
    ids = [tok.encode_prompts([p])[0] for p in PROMPTS[:4]]
    merged = decode(pool, [DecodeRow(pool.empty(), i, "all") for i in ids])
    raw = max(float(np.abs(merged.row(k) - decode(pool, [DecodeRow(pool.empty(), i, "all")]).row(0)).max())
              for k, i in enumerate(ids))
    del merged, alone, together
    model.llama.close()
    return {"worst": worst, "differ": differ, "took": took, "raw": raw, "n": n}


def b24h(cfg, path: Path, note: str) -> Row:
    default = measure(str(path), False, cfg.smoke)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.llamacpp_invariant", str(path), str(int(cfg.smoke))],
                          env={**os.environ, "GGML_CPU_TILED_MM": "0"}, capture_output=True, text=True, timeout=1800,
                          cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        raise RuntimeError(f"B24h's invariant process failed: {proc.stderr[-2000:]}")
    inv = json.loads(proc.stdout.strip().splitlines()[-1])
    return Row("B24h", "run_batch vs each call alone: largest log-prob difference (invariant mode)", "each call alone",
               inv["worst"], "<=", 0.0, "max |logprob diff|",
               notes=[note + "; the invariant mode in a fresh process with GGML_CPU_TILED_MM=0",
                      f"{len(PROMPTS)} programs x {inv['n']} greedy tokens: default mode {default['worst']:.4g} "
                      f"({default['differ']} texts differ), batch-invariant {inv['worst']:.4g} ({inv['differ']} differ); "
                      f"run_batch {default['took']:.2f}s default, {inv['took']:.2f}s invariant "
                      f"({inv['took'] / default['took']:.2f}x, the invariant one without the tiled kernel)",
                      f"raw llama_decode, 4 prefills merged vs each alone: default {default['raw']:.4g}, invariant "
                      f"{inv['raw']:.4g} (why the invariant mode gives each prefill its own decode)"])


if __name__ == "__main__":  # (the invariant half's own process: python -m benchmarks.llamacpp_invariant PATH SMOKE)
    print(json.dumps(measure(sys.argv[1], True, sys.argv[2] == "1")))
