"""B28d: a program over Ray actors (``continuum.cluster.run_batch``) vs ``continuum.run_batch`` in one process.

``python -m benchmarks.cluster_bench [--inputs 32] [--tokens 24] [--actors 2] [--threads 2] [--tiny]``

The program is greedy text (``--tokens`` new tokens, EOS ignored) then a choice on the continued state,
returning plain strings, on the GPT-2-small-shaped random model (``--tiny``: the 2-layer one, seconds).
The one-process run uses ``--threads`` torch threads on a model built beforehand; the cluster run starts a
local Ray with ``--actors`` CPUs, one actor per CPU (1 torch thread each, as Ray sets it), and its time
includes starting the actors and building the model in each (they live as long as the call). Prints both
times, their ratio, the overhead per input ((cluster - one process) / inputs) and whether the results are equal;
then a call over one input per actor (the fixed cost: actors started, models built) and the figures without it.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

from .model import configure_threads, load_bench, make_text

ROOT = Path(__file__).resolve().parents[1]


def make_program(tokens: int, tiny: bool) -> Callable[[str], tuple[str, str]]:
    """Runs once per actor (and once here): the model, its generators, and the program over one prompt."""
    from continuum import continuous, generate, samplers

    model = load_bench(tiny=tiny).model
    model.tokenizer.eos_token_ids = frozenset()  # every call generates exactly `tokens` (random weights)
    text = continuous(generate.text(model, samplers.greedy()))
    pick = continuous(generate.choice(model, [" yes", " no"], samplers.greedy()))

    def program(prompt: str) -> tuple[str, str]:
        s = text(prompt, max_tokens=tokens)
        return str(s)[len(prompt):], pick(s + " Sure?").value

    return program


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=24, help="new tokens of the text step")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=32, help="instances at once, per process or actor")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the one-process run")
    ap.add_argument("--tiny", action="store_true", help="the 2-layer model: a smoke run, figures mean nothing")
    args = ap.parse_args()
    configure_threads(args.threads)
    import ray

    import continuum
    from continuum import cluster

    build = functools.partial(make_program, args.tokens, args.tiny)  # picklable: the actors import this module
    tok = load_bench(tiny=True).tok
    prompts = [make_text(tok, 20 + (i * 37) % 40, offset=53 * i) for i in range(args.inputs)]

    t0 = time.perf_counter()
    program = build()
    t_build = time.perf_counter() - t0
    program(prompts[0])  # warm-up
    t0 = time.perf_counter()
    local = continuum.run_batch(program, prompts, concurrency=args.concurrency)
    t_local = time.perf_counter() - t0

    path = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)  # (continuum not installed)
    t0 = time.perf_counter()
    ray.init(num_cpus=args.actors, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}})
    t_init = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        remote = cluster.run_batch(build, prompts, actors=args.actors, concurrency=args.concurrency)
        t_cluster = time.perf_counter() - t0
        t0 = time.perf_counter()  # one input per actor: mostly the fixed cost (actors started, models built)
        cluster.run_batch(build, prompts[:args.actors], actors=args.actors, concurrency=args.concurrency)
        t_fixed = time.perf_counter() - t0
    finally:
        ray.shutdown()

    n = args.inputs
    print(f"B28d: {n} inputs x (text {args.tokens} tokens -> choice); model built in {t_build:.1f} s here "
          f"({'tiny' if args.tiny else 'GPT-2-small-shaped'}); ray.init {t_init:.1f} s (not counted); "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"one process ({args.threads} threads)   {t_local:7.2f} s   {n / t_local:6.2f} inputs/s")
    print(f"cluster ({args.actors} actors x 1 CPU)  {t_cluster:7.2f} s   {n / t_cluster:6.2f} inputs/s   "
          f"(actor start and model build included)")
    print(f"ratio cluster / one process {t_cluster / t_local:5.2f}x; overhead per input "
          f"{(t_cluster - t_local) / n * 1000:+.0f} ms; results equal: {remote == local}")
    print(f"fixed cost (a call over {args.actors} inputs, one per actor) {t_fixed:.2f} s; without it, the cluster takes "
          f"{t_cluster - t_fixed:.2f} s: {(t_cluster - t_fixed) / t_local:.2f}x one process, "
          f"{(t_cluster - t_fixed - t_local) / n * 1000:+.0f} ms per input")


if __name__ == "__main__":
    main()
