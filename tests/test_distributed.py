"""Tensor parallelism under torchrun: 2 CPU processes (gloo) give the results of one process.

One torchrun launch runs ``tests/distributed_script.py`` (every feature, one section each) on a tiny
Llama (4 heads, 2 key/value heads: each rank holds 2 heads and 1 key/value head) saved to a temporary
folder; the same script runs first in this process without parallelism. Every rank's token ids must
equal the single process's, weights within 1e-4. Saved states: a rank's file loads with its cache
into the same rank; the single-process file, another rank's file, and (here, in one process) the
ranks' files are recomputed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORLD = 2
ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4


def _gloo_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


pytestmark = [pytest.mark.skipif(not _gloo_available(), reason="torch.distributed with gloo is not available"),
              pytest.mark.slow]  # ~45 s: one torchrun launch (2 processes), the single-process run, the tokenizer


@pytest.fixture(scope="module")
def runs(tmp_path_factory, llama_dir):
    """(single-process results, [results of each rank], output folder, model folder)."""
    import distributed_script

    from continuum import models

    model_dir = llama_dir
    out = tmp_path_factory.mktemp("tp-out")
    # one torch thread, as each rank has (OMP_NUM_THREADS=1 below): the tiny model gains nothing from two, and two
    # OpenMP threads stall at every op's barrier on a loaded 2-core machine (this run: 22 s with two, measured)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = distributed_script.main(str(model_dir), out, model=models.transformers(str(model_dir)))
    finally:
        torch.set_num_threads(threads)

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(ROOT / "tests" / "distributed_script.py"), "--model", str(model_dir), "--out", str(out)]
    # its own process group: a hang kills the ranks too (subprocess.run's timeout kills only torchrun itself)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=110)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish in 110 s:\n{stderr[-4000:]}")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-6000:]}"
    ranks = [json.loads((out / f"results-tp{WORLD}-rank{r}.json").read_text()) for r in range(WORLD)]
    return single, ranks, out, model_dir


def _same(case: str, got: dict, want: dict) -> None:
    assert got.get("ids") == want.get("ids"), f"{case}: token ids differ\n{got.get('texts')}\n{want.get('texts')}"
    assert got.get("value") == want.get("value"), f"{case}: values differ: {got.get('value')!r} != {want.get('value')!r}"
    if "weights" in want:
        torch.testing.assert_close(torch.tensor(got["weights"]), torch.tensor(want["weights"]), atol=TOLERANCE, rtol=0,
                                   msg=lambda m: f"{case}: weights differ: {m}")


def test_every_rank_gives_the_single_process_results(runs):
    single, ranks, _, _ = runs
    import distributed_script

    sections = {case.split("/")[0] for case in single} - {"layout"}
    assert sections == set(distributed_script.SECTIONS)  # every section ran (a new one is covered by this test)
    for rank, results in enumerate(ranks):
        assert results["layout"]["value"].startswith(f"rank {rank} of {WORLD} (tp_plan auto:")
        for case, want in single.items():
            if case != "layout":
                _same(f"rank {rank}: {case}", results[case], want)


def test_prefix_cache_and_chat_under_tensor_parallelism(runs):
    """Beyond equal ranks: the prefix cache was hit on every rank and changed nothing, and a chat ran its turns."""
    single, ranks, _, _ = runs
    for results in [single, *ranks]:
        hit, reused, bounded = results["prefix_cache/hits"]["value"]
        assert hit and reused > 0 and bounded
        _same("prefix cache hit vs no cache", results["prefix_cache/again"], results["prefix_cache/again_uncached"])
        assert [m["role"] for m in results["chat/forks"]["value"][0]][-2:] == ["user", "assistant"]


def test_saved_states_across_layouts(runs, caplog):
    """A rank's own file keeps its cache; the single-process file and another rank's file are recomputed on
    every rank (with the same continuation as the single process's own file); the ranks' files loaded in one
    process are recomputed too."""
    from continuum import SequenceState, continuous, generate, models, samplers

    single, ranks, out, model_dir = runs
    want = single["save_load/own"]
    assert want["kept"]
    for rank, results in enumerate(ranks):
        assert results["save_load/own"]["kept"], f"rank {rank} lost the cache of its own file"
        for case in ("from_single", "from_other_rank"):
            got = results[f"save_load/{case}"]
            assert not got["kept"], f"rank {rank}: {case} kept a cache computed under another layout or rank"
            _same(f"rank {rank}: {case}", got, want)
    model = models.transformers(str(model_dir))
    story = continuous(generate.text(model, samplers.greedy()))
    for rank in range(WORLD):
        with caplog.at_level(logging.WARNING, logger="continuum"):
            loaded = SequenceState.load(out / f"state-tp{WORLD}-rank{rank}.safetensors", model)
        assert any(f"rank {rank} of {WORLD}" in r.getMessage() and "cache is dropped" in r.getMessage()
                   for r in caplog.records if r.name == "continuum")
        assert int(loaded.cached_tokens.sum()) == 0
        got = story(loaded, max_tokens=4)
        _same(f"rank {rank}'s file in one process", {"ids": [i for i, _ in got._real_rows()], "value": None,
                                                    "weights": got.weights.flatten().tolist()}, want)
