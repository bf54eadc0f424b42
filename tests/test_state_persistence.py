"""SequenceState: persistence. Saving and loading a state (a file of another tokenizer refused), a stored part as
bytes or as a file, the shared leading columns a part leaves out, and saving over the file a loaded state reads.
The reuse invariants: ``test_state_reuse.py``; indexing, adding and stacking: ``test_state_algebra.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from continuum import SequenceState
from continuum.errors import StateFileError

from conftest import kv_layers
from state_support import PROMPTS, greedy_c


# ---------------------------------------------------------------- persistence
def test_save_and_load(model, tmp_path, bpe_tokenizer, spm_tokenizer):
    s = greedy_c(model)(PROMPTS[:2], max_tokens=4)
    s.save(tmp_path / "s.safetensors")
    loaded = SequenceState.load(tmp_path / "s.safetensors", model)
    assert list(loaded) == list(s) and torch.equal(loaded.weights, s.weights)
    assert loaded.last_text == s.last_text
    assert list(greedy_c(model)(loaded, max_tokens=3)) == list(greedy_c(model)(s, max_tokens=3))
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    with pytest.raises(StateFileError):
        SequenceState.load(tmp_path / "bad.safetensors", model)


def test_a_part_as_bytes_loads_as_its_file(model, tmp_path):
    """part_bytes (what the PostgreSQL store keeps) and save_part's file load into the same state, KV included,
    and a continuation from either equals one from the original; garbage bytes are a StateFileError."""
    from continuum.state.parts import load_part, part_bytes, save_part, shared_columns

    base = greedy_c(model)(PROMPTS[:2], max_tokens=3)
    s = greedy_c(model)(base, max_tokens=4)
    start = shared_columns(s, base)
    save_part(s, tmp_path / "p.safetensors", start)
    from_file = load_part(tmp_path / "p.safetensors", model, base)
    from_bytes = load_part(part_bytes(s, start), model, base)
    assert start > 0 and list(from_bytes) == list(from_file) == list(s)
    assert all(torch.equal(a, b) for pa, pb in zip(kv_layers(from_bytes), kv_layers(from_file)) for a, b in zip(pa, pb))
    assert list(greedy_c(model)(from_bytes, max_tokens=3)) == list(greedy_c(model)(s, max_tokens=3))
    with pytest.raises(StateFileError):
        load_part(b"garbage bytes", model, None)


def test_shared_columns_matches_a_column_by_column_scan(model):
    """A stored part shares the leading columns whose ids, mask and log-probs are equal (NaN equal to NaN, -0.0 to
    0.0): checked against a plain scan, for a continued state and for edits at random columns of each kind."""
    import math
    import random

    from continuum.state.parts import shared_columns

    def scan(a, b) -> int:
        n = min(a._ids.shape[1], b._ids.shape[1])
        for j in range(n):
            for r in range(a.rows):
                x, y = float(a._logprobs[r, j]), float(b._logprobs[r, j])
                if int(a._ids[r, j]) != int(b._ids[r, j]) or bool(a._mask[r, j]) != bool(b._mask[r, j]) or \
                        not (x == y or (math.isnan(x) and math.isnan(y))):
                    return j
        return n

    def edited(s, r, j, lp=None, token=None):
        ids, lps = s._ids.clone(), s._logprobs.clone()
        if lp is not None:
            lps[r, j] = lp
        if token is not None:
            ids[r, j] = token
        return SequenceState(model=s._model, ids=ids, mask=s._mask, logprobs=lps, weights=s._weights, kv=s._kv,
                             batch=s.batch, samples=s.samples)

    base = greedy_c(model)(PROMPTS[:2], max_tokens=3)
    s = greedy_c(model)(base, max_tokens=4)
    assert shared_columns(s, base, kv=False) == scan(s, base) > 0
    other_nan = float(torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32))  # (a NaN of other bits)
    rng = random.Random(7)
    for _ in range(6):
        j, r = rng.randrange(base._ids.shape[1]), rng.randrange(base.rows)
        cases = [(edited(s, r, j, lp=-3.5), base),  # (another value)
                 (edited(s, r, j, token=(int(s._ids[r, j]) + 1) % model.vocab_size), base),  # (another token)
                 (edited(s, r, j, lp=-0.0), edited(base, r, j, lp=0.0)),  # (equal values, other bits: shared)
                 (edited(s, r, j, lp=other_nan), edited(base, r, j, lp=float("nan")))]  # (NaN and NaN: shared)
        for a, b in cases:
            assert shared_columns(a, b, kv=False) == scan(a, b)


def test_load_with_other_tokenizer_fails(gpt2_model, llama_model, tmp_path):
    s = greedy_c(gpt2_model)("x", max_tokens=2)
    s.save(tmp_path / "s.safetensors")
    with pytest.raises(StateFileError, match="tokenizer"):
        SequenceState.load(tmp_path / "s.safetensors", llama_model)


def test_saving_over_the_file_a_state_was_loaded_from_leaves_that_state_whole(tmp_path):
    """A state loaded from a file may read its tensors from the file's mapping (safetensors loads without copying):
    saving another state to the same path wrote the file in place, and the loaded state's next read of its KV died
    with a bus error (found by the oracle's long profile, which saves and loads through one path). The file is now
    written beside and moved onto the path. In a child process: a regression kills it, not the suite."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conftest import make_bpe_tokenizer, tiny_gpt2
        from continuum import SequenceState, continuous, generate, models, samplers
        tok = make_bpe_tokenizer()
        m = models.Transformers(tiny_gpt2(len(tok)), tok)
        text = continuous(generate.text(m, samplers.greedy()))
        path = {str(tmp_path / "state.safetensors")!r}
        long = text("Once upon a time " * 20, max_tokens=40)
        long.save(path)
        loaded = SequenceState.load(path, m)
        text("Hi", max_tokens=2).save(path)  # a much smaller file over the same path
        again = text(loaded[:, :, :], max_tokens=4)  # reads every column of the loaded KV
        fresh = text(list(long), max_tokens=4)
        assert again.token_ids[0, -4:].tolist() == fresh.token_ids[0, -4:].tolist()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=str(Path(__file__).parents[1]))
    assert out.returncode == 0 and "ok" in out.stdout, (out.returncode, out.stderr[-2000:])
