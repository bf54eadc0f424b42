"""B25: speculative decoding on states (``speculate=speculate.lookup()``) on llama.cpp, paired in one run.

The model: Gemma 3 270M Q4_K_M (registry package) when installed, else the stories260K f32 GGUF (noted); 2 threads.
Greedy; tokens/s counts generated tokens; each pair runs the same call with and without speculation.

* B25a: re-stating a document (the prompt holds it, the model writes it again): tokens/s ratio (>= 2.5x);
* B25b: JSON fields extracted from a document under their schema: tokens/s ratio (>= 1.5x);
* B25c: short prose continuations (nothing to look up): tokens/s ratio (>= 0.95x: never slower);
* B25d: the re-statement vs llama-cpp-python's ``LlamaPromptLookupDecoding`` (its own prompt lookup): (>= 1.2x);
* B25e: 32 programs under ``run_batch`` (compute-bound steps): tokens/s ratio (>= 1.0x).
* B25f: a draft model on transformers (``speculate.draft``): the stories260K target with its own weights as the
  draft, greedy: target forwards per generated token (<= 0.25 with ``max_draft=4``: every draft kept is 0.2 plus
  the prefill's).

The notes give the target forwards per generated token (``state._last.speculation``).
"""

from __future__ import annotations

import time

from .llamacpp_bench import gguf_bench
from .model import Bench
from .results import Row, log

__all__ = ["SPECULATION_SCENARIOS"]

DOCUMENT = ("The harbour town of Eldmere sits at the mouth of the river Sorrel. Its market opens at six every "
            "morning and closes at noon, except on Sundays, when the fishermen sell their catch on the quay until "
            "two. The town hall, built in 1782, houses a small museum of ship models and a library of sea charts. "
            "Visitors arrive by the coastal train from Marrow, which runs every ninety minutes, or by the ferry from "
            "the island of Tull, which crosses twice a day in summer and once a day in winter.")
SCHEMA = {"type": "object", "properties": {
    "town": {"type": "string", "maxLength": 30}, "river": {"type": "string", "maxLength": 30},
    "market_opens": {"type": "string", "maxLength": 20}, "town_hall_built": {"type": "integer"},
    "train_from": {"type": "string", "maxLength": 30}, "ferry_from": {"type": "string", "maxLength": 30}},
    "required": ["town", "river", "market_opens", "town_hall_built", "train_from", "ferry_from"]}
PROSE = ["Once upon a time", "The little dog", "One day, Lily", "The sun was hot"]


def _timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _new(state, prompt_len: int) -> int:
    return int((~state.token_logprobs[0].isnan()).sum()) if state.batch == 1 else 0


def _pair(bench: Bench, make, prompt: str, tokens: int, reps: int) -> tuple[float, float, dict]:
    """(tokens/s without, with speculation, the last speculative call's counters), medians over ``reps``."""
    from continuum import continuous, speculate

    plain, spec = continuous(make()), continuous(make(speculate=speculate.lookup()))
    plain(prompt, max_tokens=4)  # (warm: compile the guide, fill caches)
    base, cont, stats = [], [], {}
    for _ in range(reps):
        s, a = _timed(lambda: plain(prompt, max_tokens=tokens))
        base.append(_new(a, 0) / s)
        s, b = _timed(lambda: spec(prompt, max_tokens=tokens))
        cont.append(_new(b, 0) / s)
        stats = dict(b._last.speculation or {}, generated=_new(b, 0), same=str(a) == str(b))
    return sorted(base)[len(base) // 2], sorted(cont)[len(cont) // 2], stats


def _row(id_: str, title: str, base: float, cont: float, threshold: float, stats: dict, name: str) -> Row:
    per = (stats.get("forwards", 0) + 1) / max(1, stats.get("generated", 1))
    return Row(id_, title, "the same call without speculation", cont / base, ">=", threshold, "x tokens/s",
               base_tps=base, cont_tps=cont,
               notes=[f"model: {name}", f"target forwards per token {per:.2f} (1.00 without); drafted "
                      f"{stats.get('drafted')}, kept {stats.get('accepted')}; same text: {stats.get('same')}"])


def b25(bench: Bench, cfg) -> list[Row]:
    from continuum import continuous, generate, models, run_batch, samplers, speculate

    llama_cpp, path, name, threads = gguf_bench(cfg)
    model = models.llamacpp(path, n_threads=threads)
    tokens = 16 if cfg.smoke else 60 if cfg.quick else 120
    reps = 1 if cfg.smoke else 2 if cfg.quick else max(2, cfg.reps)
    restate = DOCUMENT + "\n\nThe same text, word for word:\n\n" + DOCUMENT[:30]
    rows = []
    log("B25a: re-stating a document")
    a_base, a_cont, st = _pair(bench, lambda **k: generate.text(model, samplers.greedy(), **k), restate, tokens, reps)
    rows.append(_row("B25a", "re-stating a document", a_base, a_cont, 2.5, st, name))
    log("B25b: JSON extraction")
    extract = DOCUMENT + "\n\nThe facts above as JSON:\n"
    b = _pair(bench, lambda **k: generate.json(model, SCHEMA, samplers.greedy(), **k), extract, tokens, reps)
    rows.append(_row("B25b", "JSON fields extracted from a document", b[0], b[1], 1.5, b[2], name))
    log("B25c: short prose")
    c_base = c_cont = 0.0
    for p in PROSE:
        # (3 pairs at least: short calls, whose ratio one busy moment moves by more than the target's margin)
        x, y, st_c = _pair(bench, lambda **k: generate.text(model, samplers.greedy(), **k), p, tokens // 2, max(3, reps))
        c_base, c_cont = c_base + x, c_cont + y
    rows.append(_row("B25c", "short prose continuations", c_base, c_cont, 0.95, st_c, name))
    if cfg.quick and not cfg.smoke:  # --quick: B25a-c (B25d, llama-cpp-python's lookup, and B25e: the full mode)
        model.llama.close()
        return rows

    log("B25d: vs llama-cpp-python's LlamaPromptLookupDecoding")
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from continuum.models.llamacpp.amx import guarded_llama  # (around llama.cpp's AMX crash, as continuum loads)

    ref = guarded_llama(path, threads, n_ctx=2048, verbose=False,
                          draft_model=LlamaPromptLookupDecoding(num_pred_tokens=8))
    try:
        theirs = []
        for _ in range(reps):
            s, out = _timed(lambda: ref.create_completion(restate, max_tokens=tokens, temperature=0))
            theirs.append(out["usage"]["completion_tokens"] / s)
    finally:
        ref.close()
    lcp = sorted(theirs)[len(theirs) // 2]
    rows.append(Row("B25d", "re-stating a document vs llama-cpp-python's prompt lookup", "LlamaPromptLookupDecoding",
                    a_cont / lcp, ">=", 1.2, "x tokens/s", base_tps=lcp, cont_tps=a_cont, notes=[f"model: {name}"]))

    log("B25e: run_batch of 32")
    n = 8 if cfg.smoke else 32
    prompts = [restate if i % 2 else PROSE[i % len(PROSE)] for i in range(n)]
    plain = continuous(generate.text(model, samplers.greedy()))
    spec = continuous(generate.text(model, samplers.greedy(), speculate=speculate.lookup()))
    e_tokens = 8 if cfg.smoke else 48
    got = {}
    for label, gen in (("plain", plain), ("spec", spec)):
        s, outs = _timed(lambda gen=gen: run_batch(lambda p: gen(p, max_tokens=e_tokens), prompts))
        got[label] = sum(_new(o, 0) for o in outs) / s
    rows.append(Row("B25e", f"{n} programs under run_batch (half re-statements)", "the same without speculation",
                    got["spec"] / got["plain"], ">=", 1.0, "x tokens/s", base_tps=got["plain"], cont_tps=got["spec"],
                    notes=[f"model: {name}"]))
    model.llama.close()
    return rows


def b25f(bench: Bench, cfg) -> list[Row]:
    from continuum import continuous, generate, models, samplers, speculate

    from .model import FIXTURES

    path = FIXTURES / "models" / "stories260K"
    if not path.exists():
        log("B25f: skipped (the stories260K fixture is absent)")
        return []
    target, twin = models.transformers(str(path)), models.transformers(str(path))
    tokens = 24 if cfg.smoke else 120
    plain = continuous(generate.text(target, samplers.greedy()))
    spec = continuous(generate.text(target, samplers.greedy(), speculate=speculate.draft(twin, max_draft=4)))
    prompt = "Once upon a time, there was a little girl named Lily."
    base_s, a = _timed(lambda: plain(prompt, max_tokens=tokens))
    cont_s, b = _timed(lambda: spec(prompt, max_tokens=tokens))
    st = b._last.speculation or {}
    per = (st.get("forwards", 0) + 1) / max(1, _new(b, 0))
    return [Row("B25f", "a draft model (the target's own weights) on transformers", "one forward per token", per, "<=",
                0.25, "target forwards per token", base_s=base_s, cont_s=cont_s,
                notes=["model: stories260K (fp32, transformers)", f"drafted {st.get('drafted')}, kept "
                       f"{st.get('accepted')}, draft-model forwards {st.get('draft_forwards')}; same text: "
                       f"{str(a) == str(b)}"])]


SPECULATION_SCENARIOS = {"B25": b25, "B25F": b25f}
