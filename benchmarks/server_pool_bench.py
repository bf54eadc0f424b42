"""B26c-e: ``continuum serve`` on a GGUF under many clients, and against llama.cpp's own server.

Clients are the official ``openai`` client, one thread each, on ``/v1/completions`` (raw prompts, greedy); tokens/s
counts the completion tokens the servers report. The model is B26's (Gemma 3 270M Q4_K_M when installed).

* B26c: ``continuum serve`` on a small pool (``--n-ctx 1024``) with 64 clients x 64 tokens: every request answered
  (200), p50 / p99 latency in the notes; the figure is the share answered (== 1.0).
* B26d: ``continuum serve`` vs llama-server ``-np 16`` (per-slot KV, its defaults), 16 clients x 64 tokens:
  tokens/s ratio (>= 0.95x).
* B26e: ``run_batch`` in process at 32, 64 and 128 programs vs llama-server with as many slots and clients:
  tokens/s ratio at the largest count (>= 0.9x, issue 57), every count in the notes.
  (That throughput grows with load is B26a's row: 128 programs against the best at fewer.)

llama-server is a C++ build (``cmake --build build --target llama-server`` in llama-cpp-python's vendored
llama.cpp, ~10 minutes on 2 cores): B26d and B26e run when ``LLAMA_SERVER`` names the binary, else they are skipped
(noted). llama-server gets ``ignore_eos`` so that every reply has its tokens; continuum's replies stop at EOS, which
the counted tokens account for.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from .llamacpp_bench import gguf_bench
from .model import Bench
from .pool_bench import _prompts, _throughput
from .results import Row, Skip, log
from .serving import free_port, wait_healthy

__all__ = ["b26_serve", "SERVER_POOL_SCENARIOS"]

ROOT = Path(__file__).resolve().parents[1]


def _continuum(path: str, threads: int, n_ctx: int, store: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "continuum", "serve", path, "--port", str(port), "--store", store,
                             "--n-ctx", str(n_ctx), "--threads", str(threads), "--served-model-name", "bench",
                             "--log-level", "warning"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_healthy(proc, f"http://127.0.0.1:{port}", "continuum serve")
    return proc, f"http://127.0.0.1:{port}/v1"


def _llama_server(binary: str, path: str, threads: int, slots: int, cells_per_slot: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([binary, "-m", path, "--port", str(port), "-t", str(threads), "-tb", str(threads),
                             "-np", str(slots), "-c", str(slots * cells_per_slot), "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_healthy(proc, f"http://127.0.0.1:{port}", "llama-server")
    return proc, f"http://127.0.0.1:{port}/v1"


def _clients(url: str, n: int, tokens: int, extra: dict | None = None) -> tuple[float, list[float], int]:
    """``n`` clients at once, one completion each: (completion tokens per second, latencies, failures)."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=1800)
    prompts = _prompts(n)
    made, lat, failed = [0] * n, [0.0] * n, [0]
    lock = threading.Lock()

    def one(i: int) -> None:
        t = time.perf_counter()
        try:
            r = client.completions.create(model="bench", prompt=prompts[i], max_tokens=tokens, temperature=0,
                                          extra_body=extra or None)
            made[i] = r.usage.completion_tokens if r.usage else 0
        except Exception:  # noqa: BLE001  (counted: the figure is how many were answered)
            with lock:
                failed[0] += 1
        lat[i] = time.perf_counter() - t

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sum(made) / (time.perf_counter() - t0), lat, failed[0]


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def b26_serve(bench: Bench, cfg) -> list[Row]:
    import tempfile

    if cfg.smoke or cfg.quick:  # (servers started and driven by 64 clients: minutes, not a smoke or quick check)
        raise Skip("server scenarios run in full mode only")
    try:
        import openai  # noqa: F401
    except ImportError as exc:
        raise Skip("the openai client is needed (pip install 'continuum[test]')") from exc
    _, path, name, threads = gguf_bench(cfg)
    binary = os.environ.get("LLAMA_SERVER")
    rows: list[Row] = []
    n_c, tok = (4, 8) if cfg.smoke else (64, 64)
    with tempfile.TemporaryDirectory() as store:
        proc, url = _continuum(str(path), threads, 256 if cfg.smoke else 1024, store)
        try:
            log(f"B26c: {n_c} clients x {tok} tokens on a small pool")
            tps, lat, failed = _clients(url, n_c, tok)
        finally:
            _stop(proc)
    rows.append(Row("B26c", f"continuum serve, {n_c} clients x {tok} tokens on a 1024-cell pool", "every request",
                    (n_c - failed) / n_c, ">=", 1.0, "answered",
                    notes=[f"model: {name}", f"{tps:.0f} tokens/s; latency p50 {statistics.median(lat):.1f} s, "
                           f"p99 {sorted(lat)[max(0, int(len(lat) * 0.99) - 1)]:.1f} s; {failed} failed"]))
    if not binary or not os.path.exists(binary):
        log("B26d/B26e: skipped (set LLAMA_SERVER to a llama-server binary)")
        return rows
    n_d, tok_d = (4, 8) if cfg.smoke else (16, 64)
    with tempfile.TemporaryDirectory() as store:
        proc, url = _continuum(str(path), threads, 16384, store)
        try:
            _clients(url, 2, 4)  # (warm: the first request builds the generator)
            ours, _, _ = _clients(url, n_d, tok_d)
        finally:
            _stop(proc)
    proc, url = _llama_server(binary, str(path), threads, n_d, 512)
    try:
        _clients(url, 2, 4, {"ignore_eos": True})
        theirs, _, _ = _clients(url, n_d, tok_d, {"ignore_eos": True})
    finally:
        _stop(proc)
    rows.append(Row("B26d", f"continuum serve vs llama-server -np {n_d}, {n_d} clients x {tok_d} tokens",
                    f"llama-server -np {n_d}", ours / theirs, ">=", 0.95, "x tokens/s", base_tps=theirs, cont_tps=ours,
                    notes=[f"model: {name}; {threads} threads each"]))
    from continuum import models

    counts = [2, 4, 8] if cfg.smoke else [32, 64, 128]
    tokens = 8 if cfg.smoke else 48
    model = models.llamacpp(path, n_threads=threads, n_ctx=16384)
    ours_e = [_throughput(model, n, tokens)[0] for n in counts]
    model.llama.close()
    theirs_e = []
    for n in counts:
        proc, url = _llama_server(binary, str(path), threads, n, 256)
        try:
            theirs_e.append(_clients(url, n, tokens, {"ignore_eos": True})[0])
        finally:
            _stop(proc)
    rows.append(Row("B26e", f"run_batch vs llama-server (per-slot KV), {counts[-1]} programs / clients",
                    f"llama-server -np {counts[-1]}", ours_e[-1] / theirs_e[-1], ">=", 0.9, "x tokens/s",
                    base_tps=theirs_e[-1], cont_tps=ours_e[-1],
                    notes=[f"model: {name}; {tokens} tokens each; " + ", ".join(
                        f"{n}: {a:.0f} vs {b:.0f} tokens/s" for n, a, b in zip(counts, ours_e, theirs_e))]))
    return rows


SERVER_POOL_SCENARIOS = {"B26S": b26_serve}
