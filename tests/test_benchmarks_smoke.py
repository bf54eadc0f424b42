"""The benchmarks in CI: every scenario of ``python -m benchmarks`` runs at toy size (``--smoke``), and
the smoke version of B3: counts of computed positions (not time) in a continuous session.

A continuation turn must compute only the uncached suffix (appended text + new tokens), never the
history. Uses a tiny 2-layer GPT-2 so it runs in a few seconds.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # benchmarks/ is not an installed package: import it from the repository
    sys.path.insert(0, ROOT)

from benchmarks.helpers import user_turns  # noqa: E402
from benchmarks.model import _gpt2_tokenizer, make_text, n_tokens  # noqa: E402
from benchmarks.results import Row, format_markdown, format_table  # noqa: E402
from benchmarks.scenarios import SCENARIOS  # noqa: E402
from benchmarks.session_bench import session_token_counts  # noqa: E402


def _tiny_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    from continuum import models

    tok, _ = _gpt2_tokenizer([])
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=512, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    return models.Transformers(GPT2LMHeadModel(cfg).eval(), tok)


def test_mini_b3_computes_only_the_uncached_suffix():
    model = _tiny_model()
    history = make_text(model.tokenizer.hf, 150)
    assert abs(n_tokens(model.tokenizer.hf, history) - 150) <= 8
    turns = session_token_counts(model, history, user_turns(4), new=6)
    assert len(turns) == 4
    for i, t in enumerate(turns):
        assert t["appended"] > 0 and t["new"] == 6, t
        # the row's uncached last token + the appended text + the new tokens but the last one
        assert t["computed"] == t["appended"] + t["new"], (i, t)
        assert t["computed"] < t["history"], (i, t)
        assert t["cached_after"] == t["total_after"] - 1, (i, t)  # everything but the last token stays cached
    histories = [t["history"] for t in turns]
    assert histories == sorted(histories) and histories[-1] > histories[0]  # the history grows, the work does not


def test_result_table_formats():
    rows = [Row(id="B1", title="greedy", baseline="HF", figure=0.97, op="<=", threshold=1.0, unit="x time",
                base_s=1.0, cont_s=0.97, base_computed=95, cont_computed=95),
            Row(id="B3a", title="ttft", baseline="HF", figure=8.0, op=">=", threshold=10.0, unit="x faster")]
    assert rows[0].passed and not rows[1].passed
    text = format_table(rows)
    assert "PASS" in text and "FAIL" in text and "0.970 x time" in text
    assert format_markdown(rows).count("\n") == 3


@pytest.mark.slow
def test_every_benchmark_scenario_runs_at_toy_size(tmp_path):
    """``python -m benchmarks --smoke`` (the runner itself, in a fresh process): every scenario runs once on
    the tiny model and reports its rows, or says why it skipped; a scenario that no longer runs fails here."""
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--smoke", "--threads", "1", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    ran = data["meta"]["scenarios"]
    assert data["meta"]["mode"] == "smoke" and list(ran) == list(SCENARIOS)
    for name, r in ran.items():
        if r["skipped"]:  # a missing fixture or optional package, said on stdout
            assert f"{name}: skipped ({r['skipped']})" in proc.stdout
            continue
        assert r["rows"], name
        assert all(i.upper().startswith(name) or (name, i) == ("B1", "B2") for i in r["rows"]), (name, r["rows"])
    rows = data["rows"]
    assert [r["id"] for r in rows] == [i for r in ran.values() for i in r["rows"]]
    assert all(isinstance(r["figure"], float) and not math.isinf(r["figure"]) for r in rows), rows
    assert "targets not checked" in proc.stdout and "MISSED TARGETS" not in proc.stdout


def test_quick_runs_known_scenarios_and_every_known_miss_names_its_row():
    from benchmarks.config import QUICK
    from benchmarks.misses import KNOWN_MISSES, explain

    assert set(QUICK) <= set(SCENARIOS)
    for key, why in KNOWN_MISSES.items():
        assert explain(key) == why and explain(key + "-16a") == why
    assert explain("B22a-8a") == KNOWN_MISSES["B22a"] and explain("B2") == KNOWN_MISSES["B2"]
    assert "regression" in explain("B99") and "regression" in explain("B222")  # (B22 is not B2, nor B222 B22)
