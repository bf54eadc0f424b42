"""Mask time per row per token, per engine, on real tokenizers: ``python -m benchmarks.guide_mask``.

Walks the tokens of a valid JSON document through the guide of its schema (both engines) and
times ``guide.apply_mask`` (compute the allowed tokens of every row and apply them to a
``(rows, vocab)`` log-prob tensor, what the decoding loop does per step) for batches of 1 and 8
rows at the same position. Prints p50 / p99 / max in microseconds per row per token.
Tokenizers come from ``../shared/fixtures/tokenizers`` (``--tokenizers gpt2,llama3-bpe``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tokenizers"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ann Lee", "age": 31, "email": "ann@example.org", "tags": ["a", "bcd", "xyz"],
            "address": {"city": "Paris café 東京", "zip": 75001}, "active": True}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(tokenizer, backend: str, rows: int, reps: int = 3) -> dict:
    from continuum import generate
    from continuum.models.tokenizer import Tokenizer

    class _Model:  # generate.json needs only .tokenizer and .forward to build the guide
        forward = None

        def __init__(self, tok):
            self.tokenizer = tok

    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
    t0 = time.perf_counter()
    guide = generate.json(_Model(tok), SCHEMA, backend=backend).guide
    compile_s = time.perf_counter() - t0
    text = json.dumps(DOCUMENT, ensure_ascii=False)
    ids = tok.encode_continuation(text)
    vocab = len(tok.hf)
    per_row = []
    for _ in range(reps):
        states = [guide.new_state() for _ in range(rows)]
        for t in ids:
            logprobs = torch.zeros((rows, vocab))
            start = time.perf_counter()
            out = guide.apply_mask(logprobs, states)
            per_row.append((time.perf_counter() - start) / rows * 1e6)
            assert bool(torch.isfinite(out[:, t]).all()), "the document's next token is masked out"
            states = [guide.advance(s, t) for s in states]
            assert all(s is not None for s in states)
        assert all(guide.is_final(s) for s in states)
    return {"backend": backend, "rows": rows, "tokens": len(ids), "compile_ms": compile_s * 1e3,
            "p50_us": statistics.median(per_row), "p99_us": _pct(per_row, 0.99), "max_us": max(per_row),
            "samples_us": per_row}


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizers", default="gpt2,llama3-bpe")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--plot", default=None, metavar="DIR", help="also write DIR/guide_mask.png (needs matplotlib)")
    ap.add_argument("--engines", default="llguidance,outlines", help="comma-separated engines to time")
    args = ap.parse_args(argv)
    dists: dict[str, list[float]] = {}  # --plot: per-row mask times per tokenizer / engine / batch
    if args.plot:  # fail now (matplotlib missing), not after measuring
        from benchmarks.plots import require_matplotlib
        require_matplotlib()
    torch.set_num_threads(1)
    print(f"{'tokenizer':<12} {'engine':<11} {'rows':>4} {'tokens':>6} {'compile ms':>10} "
          f"{'p50 us/row':>10} {'p99 us/row':>10} {'max us/row':>10}")
    for name in args.tokenizers.split(","):
        path = FIXTURES / name
        if not path.exists():
            print(f"{name}: fixture {path} not available")
            continue
        from continuum.models.tokenizer import Tokenizer

        tok = Tokenizer(AutoTokenizer.from_pretrained(str(path)))
        t0 = time.perf_counter()
        tok.llg_tokenizer  # noqa: B018 - built once per tokenizer, reported apart
        print(f"{name}: LLTokenizer built in {time.perf_counter() - t0:.2f} s, vocabulary {len(tok.hf)}")
        for backend in args.engines.split(","):
            for rows in (1, 8):
                r = measure(tok, backend, rows, args.reps)
                dists[f"{name} {backend} x{rows}"] = r["samples_us"]
                print(f"{name:<12} {backend:<11} {rows:>4} {r['tokens']:>6} {r['compile_ms']:>10.1f} "
                      f"{r['p50_us']:>10.1f} {r['p99_us']:>10.1f} {r['max_us']:>10.1f}")
    if args.plot and dists:
        from benchmarks.plots import plot_distributions
        print("chart:", plot_distributions(dists, Path(args.plot) / "guide_mask.png", xlabel="microseconds per row per token",
                                           title="JSON guide mask time per engine (rows x1 / x8 per call)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
