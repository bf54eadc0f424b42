"""End to end on the JSONSchemaBench sample with a real model: ``python -m benchmarks.jsonschema_bench --model PATH``.

For each category (fixture file) a stratified sample (``--per-category N`` schemas spread over the
file; all with ``--per-category 0``), ``generate.json`` with the library defaults (closed objects,
``on_unsupported="approximate"``), greedy, ``bounds`` (``--bounds``, default ``"small"``: the recommended
bounds for small models; ``--max-string-length``/``--max-items`` override its), prompt ``"Once upon a time,
JSON: "`` and ``max_tokens`` up to the model's context. ``python -m benchmarks.jsonschema_e2e [options]``
runs it on ``../shared/fixtures/models/stories260K`` unless ``--model`` says otherwise. Each schema runs in a
worker process killed after ``--schema-timeout`` seconds. Outcomes:

* ``valid``: returned, and valid under the ORIGINAL schema (checked again here with ``jsonschema``);
* ``flagged``: ``SchemaViolationError`` (an approximated keyword was violated: never returned);
* ``incomplete-max_tokens`` / ``incomplete-context``: ``IncompleteGenerationError``, by cause;
* ``SILENT-INVALID``: returned yet invalid (must be 0);
* ``refused`` / ``error`` / ``timeout``: no generator (compile) or a failure.

``--compile-only`` measures only the generator's creation (the compile-rate sweep, cheaper).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

PROMPT = "Once upon a time, JSON: "


def _worker(conn, model_path: str, compile_only: bool, max_tokens: int, max_string_length: int | None = None,
            max_items: int | None = None, bounds: str = "small") -> None:
    import torch

    from continuum import generate, models, samplers
    from continuum.errors import IncompleteGenerationError, SchemaViolationError, UnsupportedSchemaError
    from continuum.guides.normalize import dialect_of
    from continuum.guides.prepare import original_validator

    torch.set_num_threads(1)
    model = models.transformers(model_path)
    room = model.context_length - len(model.tokenizer.encode_continuation(PROMPT)) - 1
    budget, capped = min(max_tokens, room), max_tokens >= room  # capped: max_tokens is the context's limit
    while True:
        try:
            schema = conn.recv()
        except EOFError:
            return
        out: dict = {}
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gen = generate.json(model, schema, samplers.greedy(), max_string_length=max_string_length,
                                    max_items=max_items, bounds=None if bounds == "none" else bounds)
            out["compile_s"], out["exact"] = time.perf_counter() - t0, gen.exact
            out["not_enforced"] = list(gen.not_enforced)[:5]
            if compile_only:
                out["outcome"] = "compiled"
            else:
                t1 = time.perf_counter()
                try:
                    value = gen(PROMPT, max_tokens=budget)
                    ok = original_validator(schema, dialect_of(schema)).is_valid(value)
                    out["outcome"] = "valid" if ok else "SILENT-INVALID"
                except SchemaViolationError as exc:
                    out["outcome"], out["reason"] = "flagged", f"{exc.rule}"[:120]
                except IncompleteGenerationError as exc:
                    out["outcome"] = ("incomplete-context" if capped or "context length (" in str(exc)
                                      else "incomplete-max_tokens")
                out["generate_s"] = time.perf_counter() - t1
        except UnsupportedSchemaError as exc:
            out["outcome"], out["reason"] = "refused", (exc.keyword or "") + ": " + str(exc)[:160]
        except Exception as exc:  # noqa: BLE001 - reported as an error with its type
            out["outcome"], out["reason"] = "error", f"{type(exc).__name__}: {str(exc)[:160]}"
        conn.send(out)


class _Worker:
    def __init__(self, *args):
        self.args = args
        self._start()

    def _start(self):
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_worker, args=(child, *self.args), daemon=True)
        self.proc.start()
        self.first = True

    def run(self, schema, timeout: float) -> dict:
        self.conn.send(schema)
        if self.conn.poll(timeout + (120 if self.first else 0)):  # + loading the model
            self.first = False
            return self.conn.recv()
        self.proc.kill()
        self.proc.join()
        self._start()
        return {"outcome": "timeout", "reason": f"over {timeout:g} s"}


def _sample(path: Path, n: int) -> list[dict]:
    lines = [ln for ln in path.read_text().split("\n") if ln.strip()]  # not splitlines: keys hold U+2029
    if n and len(lines) > n:
        step = len(lines) / n
        lines = [lines[int(i * step)] for i in range(n)]
    return [json.loads(ln) for ln in lines]


def _table(records: list[dict], compile_only: bool) -> str:
    cols = ["compiled"] if compile_only else ["valid", "flagged", "incomplete-max_tokens", "incomplete-context",
                                              "SILENT-INVALID"]
    cols += ["refused", "error", "timeout"]
    by = defaultdict(list)
    for r in records:
        by[r["id"].split("/")[0]].append(r)
    head = "| category | schemas | " + " | ".join(cols) + " | compiled (rate) | exact | compile p50/max ms |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for cat, rs in [*sorted(by.items()), ("TOTAL", records)]:
        c = Counter(r["outcome"] for r in rs)
        comp = sorted(1000 * r["compile_s"] for r in rs if "compile_s" in r)
        p50 = comp[len(comp) // 2] if comp else float("nan")
        lines.append(f"| {cat} | {len(rs)} | " + " | ".join(str(c[k]) for k in cols) +
                     f" | {len(comp)} ({100 * len(comp) / max(1, len(rs)):.1f}%) | {sum(r.get('exact', 0) for r in rs)} | "
                     f"{p50:.0f} / {comp[-1] if comp else float('nan'):.0f} |")
    if not compile_only:
        done = [r for r in records if r["outcome"] in ("valid", "flagged", "SILENT-INVALID")]
        ran = [r for r in records if r["outcome"] not in ("refused", "error", "timeout")]
        full = sum(r["outcome"] == "incomplete-context" for r in ran)
        lines.append(f"\nRuns that filled the context: {full} of {len(ran)} ({100 * full / max(1, len(ran)):.1f}%)")
        lines.append(f"Outputs that fit the context: {len(done)}; valid {sum(r['outcome'] == 'valid' for r in done)} "
                     f"({100 * sum(r['outcome'] == 'valid' for r in done) / max(1, len(done)):.1f}%)")
    return "\n".join(lines)


def run(args) -> int:
    """The ``--model`` mode of ``benchmarks.jsonschema_bench`` (``args`` from its parser)."""
    files = sorted(Path(args.schemas).glob("*.jsonl"))
    if not files or not Path(args.model).exists():
        print(f"no schemas in {args.schemas} or no model at {args.model}: nothing to measure")
        return 0
    bounds = (args.max_string_length or None, args.max_items or None, args.bounds)
    worker, records, t0 = _Worker(args.model, args.compile_only, args.max_tokens, *bounds), [], time.time()
    for path in files:
        for rec in _sample(path, args.per_category):
            out = worker.run(rec["schema"], args.schema_timeout)
            out["id"] = rec["id"]
            records.append(out)
        print(f"{path.stem}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    worker.proc.kill()
    print(f"bounds={bounds[2]!r}, max_string_length={bounds[0]}, max_items={bounds[1]}")
    print(_table(records, args.compile_only))
    failing = [r for r in records if r["outcome"] not in ("valid", "compiled")]
    print("\nNot valid, with reasons:")
    for r in failing:
        unenforced = '(not enforced: ' + '; '.join(r['not_enforced']) + ')' if r.get('not_enforced') else ''
        print(f"- {r['id']}: {r['outcome']} {r.get('reason', '')} {unenforced}")
    if args.json:
        Path(args.json).write_text(json.dumps(records))
    return 1 if any(r["outcome"] == "SILENT-INVALID" for r in records) else 0


if __name__ == "__main__":  # python -m benchmarks.jsonschema_e2e: the --model mode on stories260K by default
    import runpy

    from benchmarks.model import FIXTURES

    argv = sys.argv[1:]
    if not any(a == "--model" or a.startswith("--model=") for a in argv):
        argv = ["--model", str(FIXTURES / "models" / "stories260K"), *argv]
    sys.argv = ["benchmarks.jsonschema_bench", *argv]  # (its command line; run by name: no import circle)
    runpy.run_module("benchmarks.jsonschema_bench", run_name="__main__")
