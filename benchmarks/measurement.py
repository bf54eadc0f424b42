"""Measuring calls: one timed call (:func:`measure`, a :class:`Call`), paired repetitions (:func:`paired`),
peak RSS, the garbage collection before each call, and :func:`median`.

Measurement protocol (every scenario):

* one warm-up call of each side, not measured;
* ``reps`` repetitions, each running the baseline and continuum back to back, alternating which
  goes first, so slow drifts of a shared machine hit both sides alike;
* the figure is the MEDIAN of the per-repetition ratios (a paired estimate); the times shown are
  the medians of each side. Positions computed and forward time come from the bench's
  :class:`~benchmarks.counting.ForwardCounter`.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import Bench


# ---------------------------------------------------------------------------------------------- gc
# gc.collect() before every measured call keeps one call's garbage out of the next one's time and peak
# RSS; it costs ~0.5 s a call with transformers loaded, which a --smoke run (no figure checked) skips.
COLLECT = True


def collect() -> None:
    if COLLECT:
        gc.collect()


# ---------------------------------------------------------------------------------------------- RSS
def _read_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])  # kB
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux ``clear_refs`` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    kb = _read_status("VmHWM")
    if kb is None:  # fall back to the process-lifetime peak
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024.0


# ---------------------------------------------------------------------------------------------- calls
@dataclass
class Call:
    """One measured call."""

    seconds: float
    cpu_seconds: float  # process CPU time (all threads): less sensitive than wall time to other processes
    generated: int  # new tokens per row, as returned by the measured function
    computed: int  # positions passed to the model's forward
    forward_calls: int
    forward_seconds: float
    peak_rss_mb: float
    extra: dict = field(default_factory=dict)


def measure(bench: Bench, fn: Callable[[], object], collect_first: bool = True) -> Call:
    """Run ``fn`` once, timed. ``fn`` returns the number of new tokens (or a dict with ``generated``).
    ``collect_first=False``: no ``gc.collect()`` before it (a full collection walks ~400k objects, leaving the caches
    cold and returning freed arenas to the system, which the next call pays for in proportion to what it allocates:
    B22b's run_batch, right after one, 0.78x lockstep against 0.84x without one; a running program never collects
    before each call)."""
    if collect_first:
        collect()
    reset_peak_rss()
    t0, c0, f0 = bench.counter.snapshot()
    cpu0 = time.process_time()
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    t1, c1, f1 = bench.counter.snapshot()
    extra = dict(out) if isinstance(out, dict) else {"generated": out}
    generated = int(extra.pop("generated", 0) or 0)
    return Call(seconds, cpu, generated, t1 - t0, c1 - c0, f1 - f0, peak_rss_mb(), extra)


def paired(bench: Bench, baseline: Callable, candidate: Callable, reps: int, warmup: int = 1,
           log: Callable[[str], None] | None = None) -> tuple[list[Call], list[Call]]:
    """Warm up, then ``reps`` back-to-back pairs (alternating order). Returns (baseline calls, continuum calls)."""
    for _ in range(warmup):
        baseline()
        candidate()
    base, cand = [], []
    for i in range(reps):
        if i % 2 == 0:
            b = measure(bench, baseline)
            c = measure(bench, candidate)
        else:
            c = measure(bench, candidate)
            b = measure(bench, baseline)
        base.append(b)
        cand.append(c)
        if log:
            log(f"    rep {i + 1}/{reps}: baseline {b.seconds:.3f}s  continuum {c.seconds:.3f}s  "
                f"ratio {c.seconds / b.seconds:.3f}")
    return base, cand


def median(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else float("nan")
