"""Concurrent calls sharing forwards: threads vs one call at a time vs one list call (ratios in one run).

``python -m benchmarks.scheduler_bench [--calls 16] [--tokens 32] [--threads 2]``

The workload is B15's shape (prompts of 40-120 words, greedy, ``max_tokens`` new tokens) on the
GPT-2-small-shaped model. Prints the times, the ratios against one call at a time measured in the
same run, and the scheduler's figures: merged forwards, KV padding at the largest merged step
(cells of the merged cache / real tokens) and the p99 time between two forwards of one call.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from .model import configure_threads, load_bench, make_text


def run_threads(jobs) -> list:
    out: list = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def work(i: int) -> None:
        barrier.wait()
        out[i] = jobs[i]()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args()
    configure_threads(args.threads)
    from continuum import generate, samplers

    bench = load_bench()
    model = bench.model
    prompts = [make_text(bench.tok, 50 + (i * 97) % 110, offset=37 * i) for i in range(args.calls)]
    gen = generate.text(model, samplers.greedy())
    model.tokenizer.eos_token_ids = frozenset()  # every call generates exactly max_tokens (random weights)
    gen(prompts[0], max_tokens=2)  # warm-up
    jobs = [lambda p=p: gen(p, max_tokens=args.tokens) for p in prompts]

    t0 = time.perf_counter()
    seq = [job() for job in jobs]
    t_seq = time.perf_counter() - t0
    f0 = model.forward_calls
    model.scheduler.reset_stats()
    t0 = time.perf_counter()
    thr = run_threads(jobs)
    t_thr = time.perf_counter() - t0
    forwards = model.forward_calls - f0
    stats = model.scheduler.stats()
    t0 = time.perf_counter()
    lst = gen(prompts, max_tokens=args.tokens)
    t_list = time.perf_counter() - t0
    same = thr == seq
    print(f"model: {bench.name}; {args.calls} calls x {args.tokens} tokens; torch threads {torch.get_num_threads()}")
    print(f"one call at a time {t_seq:7.2f} s")
    print(f"threads (merged)   {t_thr:7.2f} s  {t_seq / t_thr:5.2f}x sequential, {t_list / t_thr:5.2f}x the list call; "
          f"{forwards} forwards; results equal to sequential: {same}; list results equal: {list(lst) == seq}")
    print(f"one list call      {t_list:7.2f} s  {t_seq / t_list:5.2f}x sequential")
    print(f"scheduler: peak padding {stats['peak_padding']:.3f} (merged KV cells / real tokens at the largest step), "
          f"p99 wait between two steps of one call {stats['p99_step_wait_s'] * 1000:.0f} ms, {stats['merged_forwards']} merged "
          f"forwards, {stats['new_slabs']} new slabs, {stats['joins_copied']} joins copied, {stats['alone']} alone")


if __name__ == "__main__":
    main()
