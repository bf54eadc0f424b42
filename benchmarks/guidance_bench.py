"""Benchmark B11: classifier-free guidance, batched and sequential, against unguided decoding.

Greedy text for a batch of prompts, three generators built once: unguided, CFG with
``cfg_mode="batched"`` (one forward of 2x rows per step) and ``cfg_mode="sequential"`` (two
forwards per step). Time per token: paired repetitions against the unguided generator in the same
run (see ``measurement.paired``). Peak memory: the growth of the process's peak RSS during one call
(``/proc/self/clear_refs`` reset) with glibc's mmap threshold fixed at 64 KiB (every larger tensor is
its own mapping, returned to the system when freed) and ``malloc_trim(0)`` before each call (free
heap pages are given back, so reusing them counts again): the RSS growth is then the peak of the
bytes the call touches, not allocator history. On CUDA:
``torch.cuda.max_memory_allocated`` growth.
"""

from __future__ import annotations

import ctypes

import torch

from continuum import continuous, generate, samplers

from .measurement import _read_status, collect, median, paired, peak_rss_mb, reset_peak_rss
from .model import Bench, make_text
from .results import Row, log, row_from_calls


def _glibc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _fixed_mmap_threshold() -> bool:
    """glibc: serve allocations >= 64 KiB by mmap, without the dynamic threshold (False elsewhere)."""
    libc = _glibc()
    return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(-3, 65536))  # M_MMAP_THRESHOLD


def _memory_growth_mb(bench: Bench, fn) -> float:
    """Peak memory during ``fn()`` above what was in use before it, in MB."""
    collect()
    if bench.model.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    libc = _glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    before = (_read_status("VmRSS") or 0) / 1024.0
    reset_peak_rss()
    fn()
    return peak_rss_mb() - before


def b11(bench: Bench, cfg) -> list[Row]:
    prompts = [make_text(bench.tok, cfg.b11_prompt, offset=7 + 97 * i) for i in range(cfg.b11_batch)]
    negative = make_text(bench.tok, 16, offset=500)
    new = cfg.b11_new
    gens = {"unguided": continuous(generate.text(bench.model, samplers.greedy()))}
    for mode in ("batched", "sequential"):
        gens[mode] = continuous(generate.text(bench.model, samplers.greedy(), guidance_scale=3.0, negative_prompt=negative,
                                              cfg_mode=mode))
    plen = int(gens["unguided"](prompts[:1], max_tokens=0).attention_masks[0].sum())

    def call(name):
        def f():
            state = gens[name](prompts, max_tokens=new)
            return int(state.attention_masks[0].sum()) - plen
        return f

    log(f"B11: CFG (scale 3, 16-token negative prompt), greedy, {len(prompts)} prompts x {plen} tokens, {new} new tokens")
    rows = []
    # targets: batched must never cost more than two forwards (on a GPU it is far below; on a
    # compute-bound CPU 2x rows cost nearly 2x); sequential is two forwards plus the guidance step
    for mode, threshold in (("batched", 2.0), ("sequential", 2.4)):
        base, cont = paired(bench, call("unguided"), call(mode), cfg.reps, log=log)
        same = {c.generated for c in base + cont} == {new}
        calls = median([c.forward_calls for c in cont]), median([b.forward_calls for b in base])
        note = (f"{'both sides generated' if same else 'WARNING: token counts differ from'} {new} tokens per row; "
                f"forward calls per call: {calls[0]:.0f} with CFG, {calls[1]:.0f} unguided")
        rows.append(row_from_calls(f"B11{'a' if mode == 'batched' else 'b'}", f"CFG {mode}: time per token",
                                   "unguided greedy, same prompts", base, cont, op="<=", threshold=threshold,
                                   speedup=False, notes=[note]))
    exact = bench.model.device.type == "cuda" or _fixed_mmap_threshold()
    growth = {name: max(_memory_growth_mb(bench, call(name)) for _ in range(2)) for name in gens}
    where = "CUDA max_memory_allocated" if bench.model.device.type == "cuda" else "peak RSS"
    if not exact:
        where += " (glibc mmap threshold not fixed: allocator history may blur it)"
    # batched holds a 2x-row cache (and copies in and out of it); sequential adds only the small
    # unconditional cache, allocated after the prefill's transient peak
    for mode, threshold, rid in (("batched", 2.5, "B11c"), ("sequential", 1.5, "B11d")):
        ratio = growth[mode] / growth["unguided"] if growth["unguided"] > 0 else float("nan")
        rows.append(Row(id=rid, title=f"CFG {mode}: peak memory of a call", baseline="unguided greedy, same prompts",
                        figure=ratio, op="<=", threshold=threshold, unit="x memory", reps=2,
                        notes=[f"{where} growth during a call: unguided {growth['unguided']:.1f} MB, "
                               f"CFG {mode} {growth[mode]:.1f} MB (max of 2 calls each)"]))
    return rows
