"""Benchmark scenarios B1-B22 (B3 in session_bench.py, B10 in fastforward.py, B11 guidance_bench.py, B12 chat_bench.py,
B13 prefix_bench.py, B14 distributed_bench.py, B15-B20 programs_bench.py, B18b choice_bench.py,
B21 serve_bench.py, B22 engine_bench.py, B23 reasoning_bench.py,
B24 llamacpp_bench.py, B27 hybrid_bench.py; see docs/benchmarks.md). Each returns a list of checked
:class:`Row`."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from continuum import continuous, generate, samplers

from .agents_bench import AGENT_SCENARIOS
from .chat_bench import b12
from .choice_bench import b18b
from .config import Config
from .counting import kv_bytes
from .distributed_bench import b14
from .engine_bench import ENGINE_SCENARIOS
from .fastforward import b10
from .guidance_bench import b11
from .helpers import compare_with_hf, complete, fresh, hf_generate, json_schema, new_tokens, real_len
from .hybrid_bench import HYBRID_SCENARIOS
from .llamacpp_bench import LLAMACPP_SCENARIOS
from .measurement import Call, collect, median, paired, peak_rss_mb, reset_peak_rss
from .model import Bench, make_text, n_tokens
from .pool_bench import POOL_SCENARIOS
from .prefix_bench import b13
from .programs_bench import PROGRAM_SCENARIOS
from .reasoning_bench import b23
from .remote_bench import REMOTE_SCENARIOS
from .results import Row, log, row_from_calls
from .serve_bench import b21
from .server_pool_bench import SERVER_POOL_SCENARIOS
from .session_bench import b3
from .speculation_bench import SPECULATION_SCENARIOS
from .startup_bench import STARTUP_SCENARIOS


def _check_counts(rows_notes: list, what: str, base: list[Call], cont: list[Call]) -> None:
    b, c = {x.generated for x in base}, {x.generated for x in cont}
    if b != c:
        rows_notes.append(f"{what}: new tokens differ (baseline {sorted(b)}, continuum {sorted(c)})")


# ---------------------------------------------------------------------------------------------- B1 + B2
def b1_b2(bench: Bench, cfg: Config) -> list[Row]:
    prompt = make_text(bench.tok, cfg.b1_prompt)
    plen = n_tokens(bench.tok, prompt)
    text_c = continuous(generate.text(bench.model, samplers.greedy()))

    log(f"B1/B2: greedy, {plen}-token prompt, {cfg.b1_new} new tokens")
    b, c, same = compare_with_hf(bench, prompt, cfg.b1_new, lambda: text_c(prompt, max_tokens=cfg.b1_new),
                                 cfg.b1_reps, do_sample=False)
    notes = [f"prompt {plen} tokens"]
    _check_counts(notes, "B1", b, c)
    notes.append("continuum and HF produced identical tokens" if same else "WARNING: continuum and HF tokens differ")
    r1 = row_from_calls("B1", f"greedy {plen}+{cfg.b1_new} tokens", "HF generate(do_sample=False)", b, c,
                        op="<=", threshold=1.00, speedup=False, notes=notes)
    # B2: the same continuum calls against the time spent inside the model's forward during them
    overhead = [x.seconds / x.forward_seconds for x in c]
    hf_overhead = [x.seconds / x.forward_seconds for x in b]
    steps = median([x.forward_calls for x in c])
    per_step = median([(x.seconds - x.forward_seconds) / max(1, x.forward_calls) * 1000 for x in c])
    hf_per_step = median([(x.seconds - x.forward_seconds) / max(1, x.forward_calls) * 1000 for x in b])
    fwd = median([x.forward_seconds for x in c])
    r2 = Row(id="B2", title="decode overhead (B1 calls)", baseline="sum of model forward times, same calls",
             figure=median(overhead), op="<=", threshold=1.05, unit="x time", base_s=fwd, cont_s=r1.cont_s,
             cont_tps=r1.cont_tps, cont_rss_mb=r1.cont_rss_mb, cont_computed=r1.cont_computed, reps=len(c),
             notes=[f"{int(steps)} forward calls; outside forward: continuum {per_step:.2f} ms/step, "
                    f"HF generate {hf_per_step:.2f} ms/step (HF total/forward = {median(hf_overhead):.3f}x); with equal "
                    f"forwards B1 would be {(fwd / steps * 1000 + per_step) / (fwd / steps * 1000 + hf_per_step):.3f}"])
    return [r1, r2]


# ---------------------------------------------------------------------------------------------- B3
def b4(bench: Bench, cfg: Config) -> list[Row]:
    history = make_text(bench.tok, min(cfg.b4_history, bench.context - cfg.b4_new - 8), offset=7)
    text_c = continuous(generate.text(bench.model, samplers.greedy()))
    one = continuous(generate.text(bench.model, samplers.greedy()))
    state = text_c(history, max_tokens=cfg.b4_new)
    full = state.texts[0]
    cut_text = full[:-cfg.b4_cut]
    info = {}

    def base():
        hf_generate(bench, cut_text, 1, do_sample=False)
        return 1

    def cont():
        s = fresh(state)
        t0 = time.perf_counter()
        sliced = s[:-cfg.b4_cut]
        info["slice_s"] = time.perf_counter() - t0
        info["kept_cached"] = int(sliced.cached_tokens.sum())
        info["kept"] = real_len(sliced)
        one(sliced, max_tokens=1)
        return 1

    log(f"B4: slice {cfg.b4_cut} characters off a {real_len(state)}-token state and resume (1 token)")
    b, c = paired(bench, base, cont, cfg.reps, log=log)
    r = row_from_calls("B4", f"slice back {cfg.b4_cut} chars + resume (TTFT)", "HF generate(text[:-200]) from scratch",
                       b, c, op=">=", threshold=10.0, speedup=True,
                       notes=[f"state {real_len(state)} tokens -> kept {info['kept']} tokens, {info['kept_cached']} of them "
                              f"cached; the slice itself took {info['slice_s'] * 1000:.1f} ms",
                              f"continuum computed {c[-1].computed} position(s) (only the uncached suffix), baseline "
                              f"{b[-1].computed}"])
    return [r]


# ---------------------------------------------------------------------------------------------- B5 + B6
def b5(bench: Bench, cfg: Config) -> list[Row]:
    Person = json_schema()
    prompt = make_text(bench.tok, 32, offset=3) + "\nThe person as JSON: "
    plen = n_tokens(bench.tok, prompt)
    json_c = continuous(generate.json(bench.model, Person, samplers.greedy()))
    text_c = continuous(generate.text(bench.model, samplers.greedy()))
    probe = json_c(prompt, max_tokens=cfg.b5_max)
    n = new_tokens(probe, plen)
    done = complete(probe)
    out = {}

    def base():
        s = text_c(prompt, max_tokens=n)
        return new_tokens(s, plen)

    def cont():
        s = json_c(prompt, max_tokens=cfg.b5_max)
        out["text"] = s.last_text
        return new_tokens(s, plen)

    log(f"B5: JSON ({n} tokens, complete={done}) vs unconstrained text of the same length")
    b, c = paired(bench, base, cont, cfg.reps, log=log)
    notes = [f"{n} tokens per call, prompt {plen} tokens; output {'complete' if done else 'cut by max_tokens'}: "
             f"{out['text'][:80]!r}{'...' if len(out['text']) > 80 else ''}"]
    _check_counts(notes, "B5", b, c)
    r = row_from_calls("B5", "JSON (pydantic) per token", "unconstrained greedy text, same token count", b, c,
                       op="<=", threshold=1.15, speedup=False, notes=notes)
    return [r]


def b6(bench: Bench, cfg: Config) -> list[Row]:
    from continuum import models

    Person = json_schema()
    firsts, seconds = [], []
    log(f"B6: creating the JSON generator, first (fresh tokenizer adapter, {cfg.b6_reps} reps) vs second time")
    for i in range(cfg.b6_reps):
        model = models.Transformers(bench.hf, bench.tok)  # a fresh adapter: empty index cache
        t0 = time.perf_counter()
        generate.json(model, Person, samplers.greedy())
        first = time.perf_counter() - t0
        again = []
        for _ in range(7):
            t0 = time.perf_counter()
            generate.json(model, Person, samplers.greedy())
            again.append(time.perf_counter() - t0)
        firsts.append(first)
        seconds.append(median(again))
        log(f"    rep {i + 1}/{cfg.b6_reps}: first {first:.3f}s  second {seconds[-1] * 1000:.2f} ms")
    ratio = median([s / f for f, s in zip(firsts, seconds)])
    return [Row(id="B6", title="JSON generator, second creation", baseline="first creation (compiles the index)",
                figure=ratio, op="<=", threshold=0.01, unit="x time", base_s=median(firsts), cont_s=median(seconds),
                reps=cfg.b6_reps, notes=["first creation includes building the tokenizer's outlines-core Vocabulary"])]


# ---------------------------------------------------------------------------------------------- B7
def b7(bench: Bench, cfg: Config) -> list[Row]:
    prompt = make_text(bench.tok, min(cfg.b7_prompt, bench.context - cfg.b7_new - 8), offset=11)
    plen = n_tokens(bench.tok, prompt)
    k = cfg.b7_samples
    gen = generate.text(bench.model, samplers.multinomial(k))
    rng = torch.Generator().manual_seed(0)

    def base(new):
        def f():
            out = hf_generate(bench, prompt, new, do_sample=True, top_k=0, num_return_sequences=k)
            return out.shape[1]
        return f

    def cont(new):
        def f():
            texts = gen(prompt, max_tokens=new, rng=rng)
            assert len(texts) == k
            return new
        return f

    log(f"B7: {k} samples from a {plen}-token prompt: first token, then {cfg.b7_new} new tokens (warm-up: short prompt)")
    short = make_text(bench.tok, 16)
    hf_generate(bench, short, 2, do_sample=True, top_k=0, num_return_sequences=k)
    gen(short, max_tokens=2, rng=rng)
    b1, c1 = paired(bench, base(1), cont(1), cfg.heavy_reps, warmup=0, log=log)
    bn, cn = paired(bench, base(cfg.b7_new), cont(cfg.b7_new), cfg.heavy_reps, warmup=0, log=log)
    ttft = row_from_calls("B7a", f"{k} samples, {plen}-token prompt: first tokens",
                          f"HF generate(num_return_sequences={k}, do_sample=True), 1 token", b1, c1,
                          op=">=", threshold=5.0, speedup=True,
                          notes=["continuum prefills the prompt once and forks; HF prefills it once per sequence"])
    whole = row_from_calls("B7b", f"{k} samples x {cfg.b7_new} new tokens: whole call",
                           f"HF generate(num_return_sequences={k}, do_sample=True)", bn, cn, op=">=", threshold=1.5,
                           speedup=True, notes=[f"tokens/s counts the tokens of one sample (x{k} for all)"])
    return [ttft, whole]


# ---------------------------------------------------------------------------------------------- B8
def b8(bench: Bench, cfg: Config) -> list[Row]:
    prompt = make_text(bench.tok, cfg.b1_prompt, offset=5)
    plen = n_tokens(bench.tok, prompt)
    k = cfg.b8_beams
    gen = continuous(generate.text(bench.model, samplers.beam_search(k)))

    log(f"B8: {k}-beam search, {plen}-token prompt, {cfg.b8_new} new tokens")
    b, c, same = compare_with_hf(bench, prompt, cfg.b8_new, lambda: gen(prompt, max_tokens=cfg.b8_new), cfg.reps,
                                 do_sample=False, num_beams=k)
    notes = ["continuum's best beam and HF's output are identical" if same
             else "WARNING: continuum's best beam differs from HF's output"]
    _check_counts(notes, "B8", b, c)
    return [row_from_calls("B8", f"{k}-beam search, {cfg.b8_new} new tokens", f"HF generate(num_beams={k})", b, c,
                           op="<=", threshold=1.00, speedup=False, notes=notes)]


# ---------------------------------------------------------------------------------------------- B9
def b9(bench: Bench, cfg: Config) -> list[Row]:
    prompt = make_text(bench.tok, min(cfg.b9_prompt, bench.context - 8), offset=13)
    k = cfg.b9_samples
    one = continuous(generate.text(bench.model, samplers.greedy()))
    fork_c = continuous(generate.text(bench.model, samplers.multinomial(k)))
    log(f"B9: fork a {n_tokens(bench.tok, prompt)}-token state into {k} samples (max_tokens=0)")
    s1 = one(prompt, max_tokens=0)
    base_bytes = kv_bytes(s1)
    seen: set = set()
    kv_bytes(s1, seen)
    collect()
    reset_peak_rss()
    rss0 = peak_rss_mb()
    c0 = bench.model.tokens_computed
    t0 = time.perf_counter()
    forked = fork_c(s1, max_tokens=0)
    dt = time.perf_counter() - t0
    rss1 = peak_rss_mb()
    computed = bench.model.tokens_computed - c0
    extra = kv_bytes(forked, seen)
    ratio = extra / base_bytes
    # one step from the fork: each sample computes its own last token only
    c0 = bench.model.tokens_computed
    fork_c(forked, max_tokens=1, rng=torch.Generator().manual_seed(0))
    step_computed = bench.model.tokens_computed - c0
    return [Row(id="B9", title=f"fork 1 state into {k} samples (max_tokens=0)", baseline="KV bytes of the 1-sample cache",
                figure=ratio, op="<=", threshold=0.1, unit="x memory", cont_s=dt, cont_rss_mb=rss1,
                cont_computed=computed, reps=1,
                notes=[f"1-sample cache {base_bytes / 2**20:.1f} MiB, extra for {k} samples {extra / 2**20:.3f} MiB "
                       f"(a copy would be {k * base_bytes / 2**20:.1f} MiB); peak RSS grew {rss1 - rss0:.1f} MB during the fork",
                       f"the first step after the fork computed {step_computed} positions ({k} samples x 1 uncached token)"])]


SCENARIOS: dict[str, Callable[[Bench, Config], list[Row]]] = {
    "B1": b1_b2, "B3": b3, "B4": b4, "B5": b5, "B6": b6, "B7": b7, "B8": b8, "B9": b9, "B10": b10, "B11": b11,
    "B12": b12, "B13": b13, "B14": b14, **PROGRAM_SCENARIOS, "B21": b21, **STARTUP_SCENARIOS, "B18B": b18b,
    **ENGINE_SCENARIOS, "B23": b23,
    **LLAMACPP_SCENARIOS, **POOL_SCENARIOS, **SERVER_POOL_SCENARIOS, **AGENT_SCENARIOS, **SPECULATION_SCENARIOS,
    **HYBRID_SCENARIOS, **REMOTE_SCENARIOS,
}
ALIASES = {"B2": "B1"}
