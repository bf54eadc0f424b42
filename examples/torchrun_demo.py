#!/usr/bin/env python
"""continuum under torchrun: one program, every rank running it (tensor parallelism).

    torchrun --nproc-per-node 2 examples/torchrun_demo.py                 # 2 processes (gloo on CPU, NCCL on GPU)
    torchrun --nproc-per-node 2 examples/torchrun_demo.py --model PATH_OR_ID
    python examples/torchrun_demo.py                                      # the same program in one process

Under torchrun the model is loaded with ``tp_plan="auto"``: every process holds a slice of every
layer's heads, the model all-reduces activations and gathers the logits, and continuum's loop runs
unchanged on each rank. The rules for the program (see docs/distributed.md):

* every rank makes the same calls with the same inputs (no ``if rank == 0`` around generation);
* random samplers get an explicit ``rng`` with the same seed on every rank;
* only printing is done by one rank; states are saved per rank (a state's cache holds that rank's heads).

At the end every rank's texts and weights are gathered and compared: they are the same everywhere.

Model: ``--model`` if given; else the ``stories260K`` fixture next to the repository (or
``$CONTINUUM_DEMO_MODEL``); else a tiny random Llama (4 heads, 2 key/value heads) built with the same
seed in every process and saved to a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: this checkout's continuum
sys.path.insert(0, str(Path(__file__).resolve().parent))

from continuum import SequenceState, continuous, generate, models, samplers  # noqa: E402


def model_path(name: str | None) -> str:
    """``name``, else a local model folder, else a tiny random model saved to a temporary folder."""
    if name:
        return name
    from demo import local_model_path, tiny_random_model  # examples/demo.py

    path = local_model_path()
    if path is not None:
        return str(path)
    tiny = tiny_random_model(seed=0)  # same seed in every process: the same weights
    folder = tempfile.mkdtemp(prefix="continuum-tp-")
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.hf.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--model", help="a local folder or a hub id (default: a local or tiny random model)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default=None, help="where each rank saves its state (default: a temporary folder)")
    args = parser.parse_args(argv)

    distributed = "WORLD_SIZE" in os.environ  # set by torchrun
    path = model_path(args.model)
    model = models.transformers(path, tp_plan="auto") if distributed else models.transformers(path)
    fp = model.fingerprint
    log = print if fp.rank == 0 else (lambda *a, **k: None)  # printing only: every rank computes everything
    log(f"{path}: {fp.layout}")

    story = continuous(generate.text(model, samplers.greedy()))
    s1 = story(["Once upon a time", "The little dog"], max_tokens=args.max_tokens, stop_at=".")
    log("turn 1:", list(s1), [round(w, 3) for w in s1.weights.flatten().tolist()])

    s2 = story(s1[..., :20] + " One day,", max_tokens=args.max_tokens)  # slice back, add text, resume
    log("turn 2:", list(s2))

    mood = continuous(generate.choice(model, [" happy", " sad"], samplers.greedy()))(s2 + " They were")
    log("choice:", mood.value)

    seeded = torch.Generator().manual_seed(0)  # the same seed on every rank: the same draws
    forks = continuous(generate.text(model, samplers.multinomial(3)))(mood[0, :], max_tokens=8, rng=seeded)
    log("3 samples:", list(forks))

    beams = continuous(generate.text(model, samplers.beam_search(2)))
    b = beams(beams(s1[1, :], max_tokens=6) + " Then", max_tokens=6)  # beams carried across two turns
    log("beams:", list(b))

    out = Path(args.out or tempfile.mkdtemp(prefix="continuum-states-"))
    file = out / f"state-rank{fp.rank}-of-{fp.world_size}.safetensors"  # one file per rank: its heads
    b.save(file)
    again = SequenceState.load(file, model)  # same rank, same layout: the cache is kept
    log("saved and reloaded with its cache:", bool(again.cached_tokens.min() > 0), "->", file)

    result = {"texts": [list(x) for x in (s1, s2, mood, forks, b)], "weights": [x.weights.tolist() for x in (s1, s2, forks, b)]}
    if distributed:
        import torch.distributed as dist

        gathered = [None] * fp.world_size
        dist.all_gather_object(gathered, result)  # a collective every rank joins
        same = all(g["texts"] == result["texts"] for g in gathered)
        log(f"all {fp.world_size} ranks produced the same texts: {same}")
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
