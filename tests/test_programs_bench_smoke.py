"""Smoke run of benchmarks B15-B20 (``benchmarks/programs_bench.py``) at a tiny size on a tiny GPT-2.

Checks that every scenario runs its baselines and ``run_batch`` side and reports a finite programs/s
ratio per target; the figures themselves are measured by ``python -m benchmarks --only B15,...``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # benchmarks/ is not an installed package: import it from the repository
    sys.path.insert(0, ROOT)

from benchmarks.counting import ForwardCounter  # noqa: E402
from benchmarks.model import Bench, _gpt2_tokenizer  # noqa: E402
from benchmarks.programs_bench import PROGRAM_SCENARIOS  # noqa: E402


class TinyConfig:
    quick, heavy_reps, b15_hf = True, 1, False
    b15_n, b15_new = 3, 2
    b16_sessions, b16_turns, b16_user, b16_new = 2, 2, 8, 2
    b17_n, b17_levels, b17_new = 2, 2, 2
    b18_n, b18_prefix = 3, 40
    b19_n, b19_article, b19_new = 2, 40, 2
    b20_n, b20_doc = 2, 40


def test_program_benchmarks_run_at_a_tiny_size():
    from transformers import GPT2Config, GPT2LMHeadModel

    from continuum import models

    tok, _ = _gpt2_tokenizer([])
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=512, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    hf = GPT2LMHeadModel(cfg).eval()
    bench = Bench(hf=hf, tok=tok, model=models.Transformers(hf, tok), name="tiny GPT-2", random_weights=True,
                  counter=ForwardCounter(hf))
    ids = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: no intra-op threads to spin on a loaded machine
    try:
        results = {name: scenario(bench, TinyConfig()) for name, scenario in PROGRAM_SCENARIOS.items()}
    finally:
        torch.set_num_threads(threads)
    for name, rows in results.items():
        assert rows, name
        for r in rows:
            assert r.id.startswith(name) and math.isfinite(r.figure) and r.figure > 0, (name, r)
            assert r.unit == "x programs/s" and r.op == ">="
        assert any("programs/s:" in n for r in rows for n in r.notes), name
        ids += [r.id for r in rows]
    assert ids == ["B15a", "B16a", "B16b", "B17", "B18", "B18b", "B19", "B20a", "B20b"]
