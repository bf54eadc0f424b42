"""JSON-schema coverage on the JSONSchemaBench sample: ``python -m benchmarks.schema_coverage``.

For every ``--every``-th schema of each file in ``../shared/fixtures/jsonschemas`` (or ``--schemas DIR``):

1. create ``generate.json(model, schema)``: compiled, ``UnsupportedSchemaError`` (a clear refusal),
   another exception (a bug), or slower than ``--timeout`` seconds (the regex's automaton blows up
   in outlines-core; the worker is killed and restarted);
2. for compiled schemas, sample one output (``multinomial``, seed 0, ``--max-tokens``) with the real
   ``stories260K`` model and validate complete outputs with ``jsonschema``. A schema that got a
   ``SchemaCoverageWarning`` may legitimately produce outputs that violate the keywords it names.

Prints a table per file and a total; ``--json FILE`` writes every record.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model import FIXTURES  # noqa: E402

STATUSES = ["valid", "warned-invalid", "INVALID", "incomplete", "unsupported", "timeout", "ERROR"]


def _worker(conn, model_path: str, max_tokens: int) -> None:
    import warnings

    import jsonschema
    import torch

    from continuum import generate, models, samplers
    from continuum.errors import IncompleteGenerationError, UnsupportedSchemaError
    from continuum.guides import SchemaCoverageWarning

    model = models.transformers(model_path)
    while True:
        try:
            schema = conn.recv()
        except EOFError:  # the parent is done
            return
        record = {}
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                gen = generate.json(model, schema, samplers.multinomial())
            record["compile_s"] = round(time.perf_counter() - t0, 3)
            warned = [str(w.message) for w in caught if issubclass(w.category, SchemaCoverageWarning)]
            try:
                value = gen("JSON: ", max_tokens=max_tokens, rng=torch.Generator().manual_seed(0))
                jsonschema.validate(value, schema)
                record["status"] = "valid"
            except IncompleteGenerationError:
                record["status"] = "incomplete"
            except jsonschema.ValidationError as exc:
                record["status"] = "warned-invalid" if warned else "INVALID"
                record["detail"] = str(exc).splitlines()[0][:200]
            except jsonschema.SchemaError:
                record["status"] = "valid"  # the sample's schema itself is malformed for jsonschema
                record["detail"] = "jsonschema rejects the schema"
        except UnsupportedSchemaError as exc:
            record["status"] = "unsupported"
            record["detail"] = str(exc)[:200]
        except Exception as exc:  # noqa: BLE001 - a bug to report, not to hide
            record["status"] = "ERROR"
            record["detail"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        conn.send(record)


class Worker:
    def __init__(self, model_path: str, max_tokens: int):
        self.args = (model_path, max_tokens)
        self._start()

    def _start(self):
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_worker, args=(child, *self.args), daemon=True)
        self.proc.start()

    def run(self, schema, timeout: float) -> dict:
        self.conn.send(schema)
        if self.conn.poll(timeout + 30):  # + model loading / generation time
            return self.conn.recv()
        self.proc.kill()
        self.proc.join()
        self._start()
        return {"status": "timeout"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemas", default=str(FIXTURES / "jsonschemas"))
    ap.add_argument("--model", default=str(FIXTURES / "models" / "stories260K"))
    ap.add_argument("--every", type=int, default=10, help="take every N-th schema of each file")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds allowed per schema")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--json", help="write every record to this file")
    args = ap.parse_args(argv)
    files = sorted(Path(args.schemas).glob("*.jsonl"))
    if not files or not Path(args.model).exists():
        print(f"no schemas in {args.schemas} or no model at {args.model}: nothing to measure")
        return 0
    worker = Worker(args.model, args.max_tokens)
    records, totals = [], Counter()
    print(f"{'file':28s} " + " ".join(f"{s:>14s}" for s in STATUSES))
    for path in files:
        counts = Counter()
        for line in path.read_text().splitlines()[::args.every]:
            rec = json.loads(line)
            out = {"id": rec["id"], **worker.run(rec["schema"], args.timeout)}
            records.append(out)
            counts[out["status"]] += 1
        totals.update(counts)
        print(f"{path.stem:28s} " + " ".join(f"{counts[s]:14d}" for s in STATUSES), flush=True)
    print(f"{'TOTAL':28s} " + " ".join(f"{totals[s]:14d}" for s in STATUSES))
    worker.proc.kill()
    for r in records:
        if r["status"] in ("INVALID", "ERROR"):
            print(f"  {r['status']} {r['id']}: {r.get('detail', '')}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
