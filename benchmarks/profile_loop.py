"""Where the time goes in the decode loop: ``python -m benchmarks.profile_loop [--py-spy] [--new 64]``.

Runs the B1 workload (greedy, 32-token prompt) with continuum and with HF ``generate`` and prints

1. a per-step timeline split from forward hooks: setup before the first forward, time inside the
   model's forward, the gaps between forwards (the loop's per-step work, adapter included), and
   the tail after the last forward (building the result state);
2. the top torch operators of one call of each (torch.profiler);
3. with ``--py-spy`` (``pip install py-spy``): samples of the continuum call, attributed to the
   deepest ``continuum/`` file:line when outside the model's forward, as ms per step.
"""

from __future__ import annotations

import argparse
import collections
import linecache
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _setup(args):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from benchmarks.model import load_bench, make_text
    from continuum import continuous, generate, samplers

    torch.set_num_threads(args.threads)
    bench = load_bench(args.model)
    gen = continuous(generate.text(bench.model, samplers.greedy()))
    prompt = make_text(bench.tok, 32)
    return bench, gen, prompt


class Timeline:
    """Timestamps of every forward of the HF model (start, end)."""

    def __init__(self, hf):
        self.events: list[tuple[float, float]] = []
        self._t = 0.0
        hf.register_forward_pre_hook(lambda m, a, k: setattr(self, "_t", time.perf_counter()), with_kwargs=True)
        hf.register_forward_hook(lambda m, a, o: self.events.append((self._t, time.perf_counter())))

    def split(self, start: float, end: float) -> dict:
        ev = [e for e in self.events if e[0] >= start and e[1] <= end]
        inside = sum(b - a for a, b in ev)
        gaps = [ev[i + 1][0] - ev[i][1] for i in range(len(ev) - 1)]
        decode_fw = [b - a for a, b in ev[1:]]
        return {"forwards": len(ev), "setup": ev[0][0] - start, "prefill": ev[0][1] - ev[0][0],
                "decode_forward_per_step": sum(decode_fw) / max(1, len(decode_fw)),
                "gap_per_step": sum(gaps) / max(1, len(gaps)), "tail": end - ev[-1][1], "inside": inside,
                "total": end - start}


def timeline(args) -> None:
    from benchmarks.scenarios import hf_generate

    bench, gen, prompt = _setup(args)
    tl = Timeline(bench.hf)
    runs = {"continuum": lambda: gen(prompt, max_tokens=args.new),
            "HF generate": lambda: hf_generate(bench, prompt, args.new, do_sample=False)}
    for f in runs.values():
        f()
    results = collections.defaultdict(list)
    for _ in range(args.reps):
        for name, f in runs.items():
            t0 = time.perf_counter()
            f()
            results[name].append(tl.split(t0, time.perf_counter()))
    print(f"B1 workload: greedy, 32-token prompt, {args.new} new tokens; median of {args.reps} calls (ms)")
    keys = ["total", "setup", "prefill", "decode_forward_per_step", "gap_per_step", "tail"]
    print(f"{'':14s}" + "".join(f"{k:>26s}" for k in keys))
    for name, rs in results.items():
        med = {k: sorted(r[k] for r in rs)[len(rs) // 2] * 1000 for k in keys}
        print(f"{name:14s}" + "".join(f"{med[k]:26.2f}" for k in keys))
    print("gap_per_step = wall time between the end of one forward and the start of the next (sampling, "
          "bookkeeping, cache wrapping)")

    import torch
    from torch.profiler import ProfilerActivity, profile

    for name, f in runs.items():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            f()
        print(f"\n{name}: top operators (self CPU time, all threads)")
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.ops))
    del torch


def workload(args) -> None:
    bench, gen, prompt = _setup(args)
    gen(prompt, max_tokens=4)
    for _ in range(args.reps):
        gen(prompt, max_tokens=args.new)


def py_spy(args) -> None:
    exe = shutil.which("py-spy")
    if exe is None:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "raw.txt")
        cmd = [exe, "record", "-r", str(args.rate), "-f", "raw", "-o", out, "--", sys.executable, "-m",
               "benchmarks.profile_loop", "--workload", "--new", str(args.new), "--reps", str(args.reps),
               "--threads", str(args.threads)] + (["--model", args.model] if args.model else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                          os.environ.get("PYTHONPATH", "")]))
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        lines = Path(out).read_text().splitlines()
    per_line: collections.Counter = collections.Counter()
    total = model = 0
    for line in lines:
        stack, n = line.rsplit(" ", 1)
        frames, n = stack.split(";"), int(n)
        if not any(f.startswith(("decode (continuum/", "_finish (continuum/")) for f in frames):
            continue
        total += n
        if any("/models/" in f and "transformers/" in f or "torch/nn/modules/module.py" in f for f in frames):
            model += n
            continue
        ours = [f for f in frames if "(continuum/" in f]
        per_line[ours[-1] if ours else frames[-1]] += n
    steps = args.reps * args.new
    ms = 1000.0 / args.rate
    print(f"py-spy, {args.rate} Hz, {args.reps} calls x {args.new} tokens: {total} samples in the decode loop, "
          f"{model} ({100 * model / max(1, total):.1f}%) inside the model's forward")
    print(f"outside the forward: {(total - model) * ms / steps:.2f} ms/step; by the deepest continuum frame:")
    root = Path(__file__).resolve().parents[1]
    for frame, n in per_line.most_common(args.ops):
        m = re.search(r"\((continuum/[^:]+):(\d+)\)", frame)
        src = linecache.getline(str(root / m.group(1)), int(m.group(2))).strip()[:70] if m else ""
        print(f"  {n * ms / steps:7.3f} ms/step  {100 * n / max(1, total):5.2f}%  {frame:55s} {src}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_loop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--ops", type=int, default=15, help="rows of the operator / line tables")
    p.add_argument("--py-spy", action="store_true", help="sample the continuum call with py-spy (line level)")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.workload:
        workload(args)
    elif args.py_spy:
        py_spy(args)
    else:
        timeline(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
