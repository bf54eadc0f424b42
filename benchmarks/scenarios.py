"""Benchmark scenarios B1-B22 (B10 in fastforward.py, B11 guidance_bench.py, B12 chat_bench.py, B13 prefix_bench.py,
B14 distributed_bench.py, B15-B20 programs_bench.py, B18b choice_bench.py,
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
from .helpers import compare_with_hf, complete, fresh, hf_generate, json_schema, new_tokens, real_len, user_turns
from .hybrid_bench import HYBRID_SCENARIOS
from .llamacpp_bench import LLAMACPP_SCENARIOS
from .measurement import Call, collect, measure, median, paired, peak_rss_mb, reset_peak_rss
from .model import Bench, make_text, n_tokens
from .pool_bench import POOL_SCENARIOS
from .prefix_bench import b13
from .programs_bench import PROGRAM_SCENARIOS
from .reasoning_bench import b23
from .remote_bench import REMOTE_SCENARIOS
from .results import Row, log, row_from_calls
from .serve_bench import b21
from .server_pool_bench import SERVER_POOL_SCENARIOS
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
def session_token_counts(model, history: str, users: list[str], new: int) -> list[dict]:
    """Run a continuous greedy session and report, per turn, the positions the model computed.

    Only the uncached suffix is computed: the row's last (uncached) token, the appended text and the
    new tokens but the last one, i.e. ``appended + new`` positions per turn, whatever the history length.
    Used by B3 and by the test suite's smoke test.
    """
    text_c = continuous(generate.text(model, samplers.greedy()))
    tok = model.tokenizer
    s = text_c(history, max_tokens=0)
    turns = []
    for u in users:
        appended = len(tok.encode_continuation(u))
        x = s + u
        before, t0 = real_len(x), model.tokens_computed
        s = text_c(x, max_tokens=new)
        generated = new_tokens(s, before)
        turns.append({"appended": appended, "new": generated, "computed": model.tokens_computed - t0,
                      "history": before - appended, "cached_after": int(s.cached_tokens.sum()), "total_after": real_len(s)})
    return turns


def b3(bench: Bench, cfg: Config) -> list[Row]:
    """Both sessions run in lockstep, turn by turn, so every per-turn ratio compares calls made seconds apart."""
    users = user_turns(cfg.b3_turns)
    per_turn = max(n_tokens(bench.tok, u) for u in users) + cfg.b3_new
    history_len = min(cfg.b3_history, bench.context - cfg.b3_turns * (per_turn + 4) - 8)
    history = make_text(bench.tok, history_len)
    hlen = n_tokens(bench.tok, history)
    text_c = continuous(generate.text(bench.model, samplers.greedy()))
    notes = [f"history {hlen} tokens, already a cached state for continuum (its one-time prefill is counted in the "
             f"session time); {cfg.b3_turns} turns, each appends a ~{n_tokens(bench.tok, users[0]) - 1}-token question "
             f"and generates {cfg.b3_new} tokens; TTFT = a max_tokens=1 call (continuum: median of {cfg.b3_ttft_inner} "
             f"probes around each baseline probe)"]
    if hlen < cfg.b3_history:
        notes.append(f"history shortened from {cfg.b3_history} to fit the {bench.context}-token context")

    def session(rep: int) -> dict:
        r = {"b_ttft": [], "c_ttft": [], "c_fwd": [], "c_ref": [], "b_turn": [], "c_turn": [], "b_comp": [], "c_comp": [],
             "b_rss": 0.0, "c_rss": 0.0}
        held = {}

        def prefill():
            held["state"] = text_c(history, max_tokens=0)
            return 0

        first = measure(bench, prefill)
        s = s0 = held["state"]
        r["c_prefill"] = first.seconds
        text = history
        for k, u in enumerate(users):
            text += u
            probes, fwds, refs = [], [], []
            for i in range(cfg.b3_ttft_inner):
                probe = measure(bench, lambda: (text_c(s + u, max_tokens=1), 1)[1])
                probes.append(probe.seconds)
                fwds.append(probe.forward_seconds)
                if i == 0:
                    b = measure(bench, lambda: hf_generate(bench, text, 1, do_sample=False).shape[1])
                    r["b_ttft"].append(b.seconds)
                # the turn-1 probe again, right now: flatness is a ratio of calls made seconds apart
                refs.append(measure(bench, lambda: (text_c(s0 + users[0], max_tokens=1), 1)[1]).seconds)
            r["c_ttft"].append(median(probes))
            r["c_fwd"].append(median(fwds))
            r["c_ref"].append(median(refs))
            out = {}

            def base_turn():
                out["ids"] = hf_generate(bench, text, cfg.b3_new, do_sample=False)
                return out["ids"].shape[1]

            def cont_turn():
                out["state"] = text_c(s + u, max_tokens=cfg.b3_new)
                return cfg.b3_new

            if (rep + k) % 2 == 0:
                bc, cc = measure(bench, base_turn), measure(bench, cont_turn)
            else:
                cc, bc = measure(bench, cont_turn), measure(bench, base_turn)
            s = out["state"]
            text += bench.tok.decode(out["ids"][0])
            r["b_turn"].append(bc.seconds)
            r["c_turn"].append(cc.seconds)
            r["b_comp"].append(bc.computed)
            r["c_comp"].append(cc.computed)
            r["b_rss"], r["c_rss"] = max(r["b_rss"], bc.peak_rss_mb, b.peak_rss_mb), max(r["c_rss"], cc.peak_rss_mb)
        r["b_session"] = sum(r["b_turn"])
        r["c_session"] = first.seconds + sum(r["c_turn"])
        log(f"    rep {rep + 1}/{cfg.heavy_reps}: session baseline {r['b_session']:.2f}s continuum {r['c_session']:.2f}s; "
            f"TTFT speedups " + " ".join(f"{x / y:.1f}" for x, y in zip(r["b_ttft"], r["c_ttft"])))
        return r

    log(f"B3: {cfg.b3_turns}-turn session on {hlen} history tokens, {cfg.b3_new} new per turn (warm-up: 1 short turn)")
    text_c(text_c(history, max_tokens=0) + users[0], max_tokens=2)
    hf_generate(bench, history + users[0], 2, do_sample=False)
    runs = [session(i) for i in range(cfg.heavy_reps)]
    T = cfg.b3_turns
    bt = [median([x["b_ttft"][k] for x in runs]) for k in range(T)]
    ct = [median([x["c_ttft"][k] for x in runs]) for k in range(T)]
    speedups = [median([x["b_ttft"][k] / x["c_ttft"][k] for x in runs]) for k in range(T)]
    # The model's own forward over the turn's uncached suffix bounds any implementation's TTFT: the
    # speedup cannot exceed baseline TTFT / that forward. Small-batch GEMMs run at a fraction of a long
    # prefill's throughput on CPU, so for a ~12-token turn the bound can sit below 10x (docs/benchmarks.md).
    bounds = [median([x["b_ttft"][k] / x["c_fwd"][k] for x in runs]) for k in range(T)]
    targets = [min(10.0, round(0.9 * bounds[k], 1)) for k in range(T)]
    worst = min(range(T), key=lambda k: speedups[k] / targets[k])
    ccomp = [int(median([x["c_comp"][k] for x in runs])) for k in range(T)]
    bcomp = [int(median([x["b_comp"][k] for x in runs])) for k in range(T)]
    counts = session_token_counts(bench.model, history, users[:2], cfg.b3_new)
    expect = [t["appended"] + t["new"] for t in counts]
    suffix_ok = [t["computed"] for t in counts] == expect
    b_rss, c_rss = max(x["b_rss"] for x in runs), max(x["c_rss"] for x in runs)
    turn_notes = [
        "TTFT per turn (s), baseline:  " + " ".join(f"{x:.3f}" for x in bt),
        "TTFT per turn (s), continuum: " + " ".join(f"{x:.3f}" for x in ct),
        "TTFT speedup per turn: " + " ".join(f"{x:.1f}" for x in speedups),
        "model-only bound per turn (baseline TTFT / the model's forward over continuum's suffix): "
        + " ".join(f"{x:.1f}" for x in bounds),
        "continuum TTFT spent inside the model's forward: " + " ".join(f"{f / t:.0%}" for f, t in zip(
            [median([x["c_fwd"][k] for x in runs]) for k in range(T)], ct)),
        "positions computed per turn, continuum: " + " ".join(map(str, ccomp)) + "; baseline: " + " ".join(map(str, bcomp)),
        f"uncached-suffix check (computed == appended + new tokens): {'OK' if suffix_ok else 'FAILED'} "
        f"{[t['computed'] for t in counts]} vs {expect}",
    ]
    if targets[worst] < 10.0:
        turn_notes.append(f"target at turn {worst + 1}: {targets[worst]}x instead of 10x, i.e. 90% of the model-only bound "
                          f"{bounds[worst]:.1f}x measured in this run (the model's forward over the uncached suffix alone "
                          f"takes 1/{bounds[worst]:.1f} of the baseline's TTFT; no implementation can beat the bound)")
    ttft_row = Row(id="B3a", title=f"session TTFT, worst of {T} turns (turn {worst + 1})",
                   baseline="HF generate re-prompting the whole text, 1 token", figure=speedups[worst], op=">=",
                   threshold=targets[worst], unit="x faster", base_s=bt[worst], cont_s=ct[worst], base_tps=1 / bt[worst],
                   cont_tps=1 / ct[worst], base_rss_mb=b_rss, cont_rss_mb=c_rss, reps=len(runs),
                   notes=notes + turn_notes,
                   series={"title": f"B3: time to first token per turn ({hlen}-token history)", "x": list(range(1, T + 1)),
                           "xlabel": "turn", "ylabel": "seconds", "log_y": True,
                           "lines": {"re-prompting (HF generate)": bt, "continuum": ct,
                                     "model-only bound (forward over the uncached suffix)":
                                     [median([x["c_fwd"][k] for x in runs]) for k in range(T)]}})
    flats = [median([x["c_ttft"][k] / x["c_ref"][k] for x in runs]) for k in range(T)]
    flat_row = Row(id="B3b", title=f"session TTFT flatness (turn {T} / turn 1)", baseline="continuum turn-1 TTFT",
                   figure=flats[-1], op="<=", threshold=1.5, unit="x time", base_s=median([x["c_ref"][-1] for x in runs]),
                   cont_s=ct[-1], reps=len(runs),
                   notes=["turn k / turn 1, the turn-1 probe re-run next to each turn-k probe: "
                          + " ".join(f"{x:.2f}" for x in flats),
                          f"the baseline's TTFT grows {bt[-1] / bt[0]:.2f}x over the same turns (unpaired)"])
    bs, cs = [x["b_session"] for x in runs], [x["c_session"] for x in runs]
    total = T * cfg.b3_new
    sess = Row(id="B3c", title=f"whole {T}-turn session", baseline="HF generate re-prompting every turn",
               figure=median([x / y for x, y in zip(bs, cs)]), op=">=", threshold=1.3, unit="x faster",
               base_s=median(bs), cont_s=median(cs), base_tps=total / median(bs), cont_tps=total / median(cs),
               base_rss_mb=b_rss, cont_rss_mb=c_rss, base_computed=sum(bcomp), cont_computed=sum(ccomp) + hlen - 1,
               reps=len(runs), notes=[f"TTFT probes excluded; continuum includes the one-time history prefill "
                                      f"({median([x['c_prefill'] for x in runs]):.2f}s, {hlen - 1} positions)"])
    return [ttft_row, flat_row, sess]


# ---------------------------------------------------------------------------------------------- B4
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
