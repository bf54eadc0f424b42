"""JSON Schema engines on the JSONSchemaBench sample: ``python -m benchmarks.jsonschema_bench``.

For each schema (every ``--every``-th of each file, at most ``--limit`` per file) and each engine,
both AFTER continuum's normaliser (``prepare_json_schema``):

* ``outlines``: continuum's outlines-core spelling (``outlines_regex``) + ``outlines_core.Index``;
* ``llguidance``: ``LLMatcher.grammar_from_json_schema`` on the normalised schema, used directly.

Measured: compiled or refused (with the refused keyword), compile time (normaliser + engine), valid
examples accepted (serialised compactly, tokenized with the real GPT-2 tokenizer, walked token by
token through the guide, then accepting), invalid examples rejected by the engine or flagged by
post-validation (``jsonschema`` on the original schema), the time to compute one row's token mask
per token (GPT-2 50k; Llama-3 128k on the first valid example, llguidance only: outlines-core
takes minutes to index that vocabulary here), and, for the engine generate.json
uses (outlines-core in this branch), end to end on a tiny random GPT-2-vocabulary model
(``max_string_length=16``, ``max_tokens=400``, greedy): outputs that validate, refused by
``SchemaViolationError``, incomplete, and SILENT invalid outputs (returned yet invalid: must be 0).

Each schema runs in a worker process killed after ``--timeout`` seconds (an outlines-core automaton
can blow up). ``--json FILE`` writes every record. ``--model PATH`` runs end to end with a real model
instead (see :mod:`benchmarks.jsonschema_e2e`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model import FIXTURES  # noqa: E402

ENGINES = ("outlines", "llguidance")


class _Tools:
    """Tokenizers, engines' vocabularies and the tiny model, built once per worker."""

    def __init__(self, e2e: bool):
        import llguidance.hf
        from transformers import AutoTokenizer

        from continuum.models.tokenizer import Tokenizer

        self.hf = {k: AutoTokenizer.from_pretrained(str(FIXTURES / "tokenizers" / d))
                   for k, d in (("gpt2", "gpt2"), ("llama3", "llama3-bpe"))}
        self.ct = {k: Tokenizer(t) for k, t in self.hf.items()}
        self.ll = {k: llguidance.hf.from_tokenizer(t) for k, t in self.hf.items()}
        self.model = None
        if e2e:
            import torch
            from transformers import GPT2Config, GPT2LMHeadModel

            from continuum import models

            torch.manual_seed(0)
            tok = self.hf["gpt2"]
            cfg = GPT2Config(vocab_size=len(tok), n_positions=1024, n_embd=32, n_layer=2, n_head=2,
                             bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
            self.model = models.Transformers(GPT2LMHeadModel(cfg).eval(), tok)
            self.ct["gpt2"] = self.model.tokenizer  # shares its index cache with generate.json


def _compile(engine: str, tools: _Tools, schema, tok: str):
    """A fresh walker factory for ``schema``: returns (start(), prepared)."""
    from continuum.errors import UnsupportedSchemaError
    from continuum.guides import outlines_regex, prepare_json_schema

    prepared = prepare_json_schema(schema)
    if engine == "outlines":
        from continuum.errors import InvalidRegexError
        from continuum.guides import regex_guide

        try:
            index = regex_guide(outlines_regex(prepared.schema), tools.ct[tok]).index
        except InvalidRegexError as exc:
            raise UnsupportedSchemaError(str(exc)[:200], keyword="outlines-core index") from exc
        return _OutlinesWalk.factory(index), prepared
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(json.dumps(prepared.schema))
    probe = LLMatcher(tools.ll[tok], grammar)
    if probe.is_error():
        raise UnsupportedSchemaError(f"llguidance: {probe.get_error()}", keyword=probe.get_error()[:60])
    return _LLWalk.factory(tools.ll[tok], grammar), prepared


class _OutlinesWalk:
    def __init__(self, index):
        self.index, self.state = index, index.get_initial_state()

    @classmethod
    def factory(cls, index):
        return lambda: cls(index)

    def mask(self):
        return self.index.get_allowed_tokens(self.state)

    def step(self, tok: int) -> bool:
        nxt = self.index.get_next_state(self.state, tok)
        if nxt is None:
            return False
        self.state = nxt
        return True

    def accepting(self) -> bool:
        return self.index.is_final_state(self.state)


class _LLWalk:
    def __init__(self, lltok, grammar):
        import llguidance.torch as lt
        from llguidance import LLMatcher

        self.m = LLMatcher(lltok, grammar)
        self.bitmask = lt.allocate_token_bitmask(1, lltok.vocab_size)
        self._fill = lt.fill_next_token_bitmask

    @classmethod
    def factory(cls, lltok, grammar):
        return lambda: cls(lltok, grammar)

    def mask(self):
        self._fill(self.m, self.bitmask, 0)

    def step(self, tok: int) -> bool:
        return self.m.consume_token(tok)

    def accepting(self) -> bool:
        return self.m.is_accepting()


def _walk(start, ids, masks: list | None) -> bool:
    w = start()
    for t in ids:
        if masks is not None:
            t0 = time.perf_counter()
            w.mask()
            masks.append(time.perf_counter() - t0)
        if not w.step(t):
            return False
    return w.accepting()


def _one(tools: _Tools, rec: dict, what: str) -> dict:
    from continuum.errors import UnsupportedSchemaError

    if what == "e2e":
        return {"e2e": _end_to_end(tools, rec["schema"])}
    out = {}
    for engine in [what]:
        r = out[engine] = {}
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                start, prepared = _compile(engine, tools, rec["schema"], "gpt2")
        except UnsupportedSchemaError as exc:
            r["status"], r["reason"] = "refused", exc.keyword or str(exc)[:60]
            continue
        except Exception as exc:  # noqa: BLE001 - reported as an engine failure
            r["status"], r["reason"] = "error", f"{type(exc).__name__}: {str(exc)[:80]}"
            continue
        r["status"], r["compile_s"] = "compiled", time.perf_counter() - t0
        r["narrowed"] = any("narrowed" in str(w.message) for w in caught)
        enc = tools.hf["gpt2"]
        masks: list[float] = []
        r["valid"] = r["valid_ok"] = r["invalid"] = r["invalid_caught"] = 0
        for ex in rec["valid_examples"]:
            try:
                prepared.validate(ex)
            except Exception:  # noqa: BLE001 - not valid under the original (dialect quirks of the sample)
                continue
            r["valid"] += 1
            ids = enc.encode(json.dumps(ex, separators=(",", ":"), ensure_ascii=False), add_special_tokens=False)
            r["valid_ok"] += _walk(start, ids, masks)
        for ex in rec["invalid_examples"]:
            r["invalid"] += 1
            ids = enc.encode(json.dumps(ex, separators=(",", ":"), ensure_ascii=False), add_special_tokens=False)
            caught = not _walk(start, ids, None)
            if not caught:
                try:
                    prepared.validate(ex)
                except Exception:  # noqa: BLE001 - flagged by post-validation
                    caught = True
            r["invalid_caught"] += caught
        r["mask_gpt2"] = masks
        # outlines-core indexes a 128k vocabulary in minutes on this machine: Llama-3 masks are llguidance's only
        if engine == "llguidance" and rec["valid_examples"] and r["valid_ok"]:
            start3, _ = _compile(engine, tools, rec["schema"], "llama3")
            ex = rec["valid_examples"][0]
            ids = tools.hf["llama3"].encode(json.dumps(ex, separators=(",", ":"), ensure_ascii=False),
                                            add_special_tokens=False)
            r["mask_llama3"] = []
            _walk(start3, ids, r["mask_llama3"])
    return out


def _end_to_end(tools: _Tools, schema) -> str:
    from continuum import generate, samplers
    from continuum.errors import IncompleteGenerationError, SchemaViolationError
    from continuum.guides.normalize import dialect_of
    from continuum.guides.prepare import original_validator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            gen = generate.json(tools.model, schema, samplers.greedy(), max_string_length=16)
            value = gen("JSON: ", max_tokens=400)
        except SchemaViolationError:
            return "refused"
        except IncompleteGenerationError:
            return "incomplete"
        except Exception as exc:  # noqa: BLE001
            return f"error {type(exc).__name__}"
    return "valid" if original_validator(schema, dialect_of(schema)).is_valid(value) else "SILENT-INVALID"


def _worker(conn, e2e: bool) -> None:
    tools = _Tools(e2e)
    while True:
        try:
            rec = conn.recv()
        except EOFError:
            return
        conn.send(_one(tools, *rec))


class Worker:
    def __init__(self, e2e: bool):
        self.e2e = e2e
        self._start()

    def _start(self):
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_worker, args=(child, self.e2e), daemon=True)
        self.proc.start()
        self.first = True

    def run(self, rec: dict, what: str, timeout: float) -> dict:
        """One engine's measures of ``rec`` (``what``: an engine or "e2e"), each part with its own timeout."""
        self.conn.send((rec, what))
        if self.conn.poll(timeout + (120 if self.first else 0)):  # + loading tokenizers and the model
            self.first = False
            return self.conn.recv()
        self.proc.kill()
        self.proc.join()
        self._start()
        return {"e2e": "timeout"} if what == "e2e" else {what: {"status": "timeout", "reason": "timeout"}}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _table(records: list[dict], e2e: bool) -> str:
    by_cat = defaultdict(list)
    for r in records:
        by_cat[r["id"].split("/")[0]].append(r)
    groups = [(c, rs) for c, rs in sorted(by_cat.items())]
    real = [r for r in records if not r["id"].startswith("Synthesized/")]
    groups += [("TOTAL without Synthesized", real), ("TOTAL", records)]
    head = ("| category | engine | schemas | compiled | narrowed | compile p50/p99 ms | valid accepted | "
            "invalid rejected/flagged | mask p50/p99 us GPT-2 | mask p50/p99 us Llama-3 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for cat, rs in groups:
        for engine in ENGINES:
            es = [r[engine] for r in rs]
            if all(e["status"] == "skipped" for e in es):
                continue
            ok = [e for e in es if e["status"] == "compiled"]
            comp = [1000 * e["compile_s"] for e in ok]
            m2 = [1e6 * x for e in ok for x in e.get("mask_gpt2", [])]
            m3 = [1e6 * x for e in ok for x in e.get("mask_llama3", [])]
            va, vo = sum(e["valid"] for e in ok), sum(e["valid_ok"] for e in ok)
            ia, io = sum(e["invalid"] for e in ok), sum(e["invalid_caught"] for e in ok)
            lines.append(f"| {cat} | {engine} | {len(es)} | {len(ok)} ({100 * len(ok) / max(1, len(es)):.1f}%) | "
                         f"{sum(e.get('narrowed', False) for e in ok)} | {_pct(comp, .5):.1f} / {_pct(comp, .99):.1f} | "
                         f"{vo}/{va} | {io}/{ia} | {_pct(m2, .5):.0f} / {_pct(m2, .99):.0f} | "
                         f"{_pct(m3, .5):.0f} / {_pct(m3, .99):.0f} |")
    out = "\n".join(lines)
    reasons = {e: Counter(r[e].get("reason") for r in real if r[e]["status"] not in ("compiled", "skipped"))
               for e in ENGINES}
    for engine, c in reasons.items():
        out += f"\n\nNot compiled ({engine}, without Synthesized), by reason: " + \
               ", ".join(f"{k} {v}" for k, v in c.most_common(12))
    if e2e:
        c = Counter(r.get("e2e") for r in records if "e2e" in r)
        out += "\n\nEnd to end (outlines-core engine, tiny random GPT-2 model, greedy, max_tokens=400, " \
               "max_string_length=16): " + ", ".join(f"{k} {v}" for k, v in c.most_common())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemas", default=str(FIXTURES / "jsonschemas"))
    ap.add_argument("--every", type=int, default=20, help="take every K-th schema of each file")
    ap.add_argument("--limit", type=int, default=None, help="at most N schemas per file")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds allowed per schema")
    ap.add_argument("--no-e2e", action="store_true", help="skip the end-to-end generation")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES))
    ap.add_argument("--json", help="write every record to this file")
    ap.add_argument("--model", help="a model directory: end to end with generate.json instead "
                    "(benchmarks/jsonschema_e2e.py; e.g. ../shared/fixtures/models/stories260K)")
    ap.add_argument("--per-category", type=int, default=10, help="--model: schemas per category (0: all)")
    ap.add_argument("--schema-timeout", type=float, default=30.0, help="--model: seconds allowed per schema")
    ap.add_argument("--max-tokens", type=int, default=512, help="--model: max_tokens (capped by the context)")
    ap.add_argument("--compile-only", action="store_true", help="--model: only create the generators")
    ap.add_argument("--bounds", default="small", choices=["default", "small", "none"],
                    help="--model: generate.json's bounds= (default: small, the recommended bounds for small models)")
    ap.add_argument("--max-string-length", type=int, default=None, help="--model: max_string_length (overrides --bounds)")
    ap.add_argument("--max-items", type=int, default=None, help="--model: max_items (overrides --bounds)")
    args = ap.parse_args(argv)
    if args.model:
        from benchmarks.jsonschema_e2e import run

        return run(args)
    files = sorted(Path(args.schemas).glob("*.jsonl"))
    if not files or not (FIXTURES / "tokenizers" / "llama3-bpe").exists():
        print(f"no schemas in {args.schemas} or no tokenizers: nothing to measure")
        return 0
    engines = set(args.engines.split(","))
    e2e = not args.no_e2e and "outlines" in engines
    worker, records = Worker(e2e), []
    t0 = time.time()
    for path in files:
        lines = [ln for ln in path.read_text().split("\n") if ln.strip()][::args.every][:args.limit]
        for line in lines:
            rec, out = json.loads(line), {}
            out["id"] = rec["id"]
            for engine in ENGINES:
                out.update(worker.run(rec, engine, args.timeout) if engine in engines else
                           {engine: {"status": "skipped", "reason": "skipped"}})
            if e2e and out["outlines"]["status"] == "compiled":
                out.update(worker.run(rec, "e2e", args.timeout))
            records.append(out)
        print(f"{path.stem}: {len(lines)} schemas ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    worker.proc.kill()
    print(_table(records, e2e))
    if args.json:
        Path(args.json).write_text(json.dumps(records))
    silent = [r["id"] for r in records if r.get("e2e") == "SILENT-INVALID"]
    if silent:
        print("SILENT INVALID OUTPUTS:", silent)
    return 1 if silent else 0


if __name__ == "__main__":
    sys.exit(main())
