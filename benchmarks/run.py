"""Benchmark runner: ``python -m benchmarks [--quick|--smoke] [--only B1,B3] [--model PATH] [--json out.json] [--plot DIR]``.

``--smoke`` runs every scenario once at toy size (a 2-layer GPT-2, a few tokens) and checks no target:
the test suite runs it, so a scenario that no longer runs fails CI. Most of its time is starting
interpreters (this one, B14's torchrun ranks, B21's server). A scenario that cannot run here (a fixture
or an optional package missing) prints ``<id>: skipped (<why>)``.

Every figure is a ratio against a baseline measured in the same run (median of paired repetitions
after a warm-up), so the check holds on a noisy machine. Exit code 0 even when targets are missed
(a summary of failures is printed), unless ``--strict``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # python benchmarks/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="the headline scenarios, fewer repetitions and shorter generations (<= 5 minutes on 2 idle cores)")
    p.add_argument("--smoke", action="store_true",
                   help="every scenario once at toy size (tiny model, a few tokens), no targets checked (the CI check)")
    p.add_argument("--only", default="", help="comma-separated scenarios, e.g. B1,B3 (B2 runs with B1)")
    p.add_argument("--model", default=None, help="a local Hugging Face causal LM folder (default: random GPT-2-small shape)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for both sides (default: 2)")
    p.add_argument("--omp-passive", action="store_true",
                   help="set OMP_WAIT_POLICY=PASSIVE (OpenMP threads sleep at barriers): steadier 2-thread torch runs on a "
                        "LOADED machine, but it halves llama.cpp's speed (B24-B26), so the runner never sets it itself")
    p.add_argument("--reps", type=int, default=None, help="override the repetitions of every scenario")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=None,
                   help="B21: concurrent clients (default 16; --quick 4); the issue's figures are taken at 16 and 64")
    p.add_argument("--json", default=None, help="write all figures and notes to this JSON file")
    p.add_argument("--markdown", default=None, help="write the table as Markdown to this file")
    p.add_argument("--strict", action="store_true", help="exit with status 1 when a target is missed")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNG charts of the per-turn / per-call figures to DIR (needs matplotlib: pip install -e '.[plot]')")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    # OpenMP's default waiting unless asked: a policy chosen for one side slows the other (PASSIVE: llama.cpp's
    # threads sleep at every graph node's barrier: 24 vs 50 tokens/s on Gemma 3 270M, measured)
    if args.omp_passive:
        if "torch" in sys.modules and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
            print("note: torch was imported before the runner; OMP_WAIT_POLICY could not be set", file=sys.stderr)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

    if args.plot:  # fail now, not after the run
        from benchmarks.plots import require_matplotlib
        require_matplotlib()

    import torch

    from benchmarks import measurement
    from benchmarks.config import QUICK
    from benchmarks.model import configure_threads, load_average, load_bench
    from benchmarks.results import Skip, format_markdown, format_table, log, write_json
    from benchmarks.scenarios import ALIASES, SCENARIOS, Config

    configure_threads(args.threads)
    cfg = Config.smoke_mode() if args.smoke else Config.quick_mode() if args.quick else Config()
    measurement.COLLECT = not cfg.smoke
    if args.reps is not None:
        cfg.reps = cfg.b1_reps = cfg.heavy_reps = cfg.b6_reps = max(1, args.reps)
    if args.clients is not None:
        cfg.clients = max(1, args.clients)  # (B21)
    chosen = [s.strip().upper() for s in args.only.split(",") if s.strip()]
    wanted = chosen or (list(QUICK) if cfg.quick and not cfg.smoke else list(SCENARIOS))
    wanted = list(dict.fromkeys(ALIASES.get(s, s) for s in wanted))
    unknown = [s for s in wanted if s not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {unknown}; choose among {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    load0 = load_average()
    bench = load_bench(args.model, seed=args.seed, tiny=cfg.smoke)
    mode = ("SMOKE mode (each scenario once at toy size: figures mean nothing, targets not checked)" if cfg.smoke
            else "QUICK mode (fewer repetitions, shorter generations)" if cfg.quick else "full mode")
    header = [
        f"continuum benchmarks, {mode}",
        f"model: {bench.name}",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}, "
        f"{os.cpu_count()} CPUs, load average at start {load0 if load0 is None else round(load0, 2)}",
        f"settings: {cfg.describe()}",
    ] + [f"note: {n}" for n in bench.notes]
    if cfg.quick and not cfg.smoke and not chosen:
        rest = [s for s in SCENARIOS if s not in QUICK]
        header.append(f"quick: {', '.join(QUICK)}; not run here: {', '.join(rest)} (the full mode, or --only)")
    if load0 is not None and load0 > 0.5 * (os.cpu_count() or 1):
        header.append("warning: the machine is busy; ratios are paired medians, but absolute times are inflated")
    print("\n".join(header), flush=True)

    rows, ran = [], {}
    for name in wanted:
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        try:
            got = SCENARIOS[name](bench, cfg)
        except Skip as why:
            print(f"{name}: skipped ({why})", flush=True)
            ran[name] = {"rows": [], "skipped": str(why), "seconds": time.perf_counter() - t0}
            continue
        log(f"  {name} done in {time.perf_counter() - t0:.1f}s")
        ran[name] = {"rows": [r.id for r in got], "skipped": None, "seconds": time.perf_counter() - t0}
        for r in got:
            r.checked = not cfg.smoke
        rows.extend(got)
    elapsed = time.perf_counter() - start
    load1 = load_average()

    print()
    print(format_table(rows))
    print()
    for r in rows:
        for n in r.notes:
            print(f"  {r.id}: {n}")
        if r.achievable:
            print(f"  {r.id}: {r.achievable}")
    failed = [] if cfg.smoke else [r for r in rows if not r.passed]
    skipped = [f"{k} ({v['skipped']})" for k, v in ran.items() if v["skipped"]]
    print()
    if cfg.smoke:
        print(f"smoke: {len(ran) - len(skipped)}/{len(ran)} scenarios ran ({len(rows)} rows) in {elapsed:.0f}s, "
              f"targets not checked" + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    else:
        print(f"{len(rows) - len(failed)}/{len(rows)} targets met in {elapsed:.0f}s ({mode}); "
              f"load average {load0 and round(load0, 2)} -> {load1 and round(load1, 2)}")
    if failed:
        print("MISSED TARGETS:")
        from benchmarks.misses import explain

        for r in failed:
            print(f"  {r.id} {r.title}: {r.figure:.3f} {r.unit}, target {r.target}")
            print(f"    why: {r.achievable or explain(r.id)}")
    meta = {"mode": "smoke" if cfg.smoke else "quick" if cfg.quick else "full", "scenarios": ran, "model": bench.name,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_average": [load0, load1], "seconds": elapsed, "settings": cfg.describe(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.json:
        write_json(args.json, meta, rows)
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(rows) + "\n")
    if args.plot:
        from benchmarks.plots import plot_rows
        sub = f"{bench.name.split(' (')[0]} · {meta['mode']} mode · {meta['date']} · load average {load0 and round(load0, 1)}"
        for path in plot_rows(rows, args.plot, subtitle=sub):
            print(f"chart: {path}")
    return 1 if (args.strict and failed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
