"""Saving a llama.cpp state keeps its KV: each distinct sequence's bytes once, behind the GGUF's fingerprint
(continuum/models/llamacpp/persist.py). Loaded on the same model nothing is recomputed and the continuation is
exactly the unsaved state's (batch-invariant mode: exact, tests/llamacpp_support.py); from another GGUF, or
damaged, the KV is dropped with a warning and recomputed in one pass; a truncated file is a clear error.
"""

from __future__ import annotations

import gc
import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from continuum import SequenceState, continuous, generate, models, samplers
from continuum.errors import StateFileError
from continuum.models import kv

from llamacpp_support import gguf


@pytest.fixture(scope="module")
def model():
    return models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=2)


def _greedy(m):
    return continuous(generate.text(m, samplers.greedy()))


def _continue(m, state, n=10):
    """The continuation of ``state`` and the positions it computed."""
    before = m.tokens_computed
    out = _greedy(m)(state, max_tokens=n)
    return out, m.tokens_computed - before


def _rewrite(path, change):
    """Rewrite a state file's tensors and metadata through ``change(tensors, meta)``."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["continuum"])
    tensors = load_file(str(path))
    change(tensors, meta)
    save_file(tensors, str(path), metadata={"continuum": json.dumps(meta)})


def test_save_load_restores_the_kv_without_recomputing_and_continues_exactly(model, tmp_path):
    s = _greedy(model)("Once upon a time", max_tokens=12)
    s.save(tmp_path / "s.safetensors")
    back = SequenceState.load(tmp_path / "s.safetensors", model)
    assert kv.opaque(back._kv) and kv.length(back._kv) == kv.length(s._kv) > 0
    assert str(back) == str(s) and torch.equal(back.weights, s.weights)
    ours, computed = _continue(model, back)
    ref, ref_computed = _continue(model, s)
    assert computed == ref_computed <= 10  # only the uncached last token and the new ones: nothing recomputed
    assert str(ours) == str(ref) and torch.equal(ours.weights, ref.weights)  # the same logits, bit for bit
    assert torch.equal(ours.token_logprobs[0].nan_to_num(), ref.token_logprobs[0].nan_to_num())


def test_rows_on_one_sequence_are_saved_once(model, tmp_path):
    two = continuous(generate.text(model, samplers.multinomial(3)))("The cat sat on the", max_tokens=0)
    assert len({v.seq_id for v in two._kv.views}) == 1  # three rows (samples), one llama.cpp sequence
    two.save(tmp_path / "two.safetensors")
    with safe_open(str(tmp_path / "two.safetensors"), framework="pt") as f:
        assert sorted(k for k in f.keys() if k.startswith("kvh.blob")) == ["kvh.blob0"]  # noqa: SIM118
    back = SequenceState.load(tmp_path / "two.safetensors", model)
    assert list(back) == list(two)
    draws = continuous(generate.text(model, samplers.multinomial(3)))
    before = model.tokens_computed
    ours = draws(back, max_tokens=6, rng=torch.Generator().manual_seed(1))
    computed, before = model.tokens_computed - before, model.tokens_computed
    ref = draws(two, max_tokens=6, rng=torch.Generator().manual_seed(1))
    assert list(ours) == list(ref) and torch.equal(ours.weights, ref.weights)
    assert computed == model.tokens_computed - before <= 3 * 6  # the uncached last token and the new ones per row


def test_a_state_loaded_while_released_cells_fill_the_pool_keeps_its_kv(tmp_path, caplog):
    """The invariant mode keeps a released state's cells until room is needed (sequences.py: drop). A load while they
    fill the pool must make that room, as a restore does, not drop the file's KV (found: it was refused and
    recomputed)."""
    small = models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=2, n_ctx=256)
    s = _greedy(small)("Once upon a time", max_tokens=40)
    s.save(tmp_path / "s.safetensors")
    big = _greedy(small)("Lily and Tom went", max_tokens=170)
    del big
    gc.collect()  # (its ~176 cells now kept by the pool's zombie id: with s's ~44, fewer free than s's bytes need)
    with caplog.at_level(logging.WARNING, logger="continuum"):
        back = SequenceState.load(tmp_path / "s.safetensors", small)
    assert not [r.getMessage() for r in caplog.records if "cannot be restored" in r.getMessage()]
    assert kv.length(back._kv) == kv.length(s._kv) > 0
    ours, computed = _continue(small, back)
    ref, ref_computed = _continue(small, s)
    assert computed == ref_computed <= 10  # nothing recomputed
    assert str(ours) == str(ref) and torch.equal(ours.weights, ref.weights)


def test_a_file_from_another_gguf_is_recomputed_with_a_warning(model, tmp_path, caplog):
    s = _greedy(model)("Once upon a time", max_tokens=12)
    s.save(tmp_path / "f32.safetensors")
    q8 = models.llamacpp(gguf("q8_0"), batch_invariant=True, n_threads=2)
    with caplog.at_level(logging.WARNING, logger="continuum"):
        back = SequenceState.load(tmp_path / "f32.safetensors", q8)
    assert any("not this model" in r.getMessage() for r in caplog.records)
    assert kv.length(back._kv) == 0 and str(back) == str(s)
    ours, computed = _continue(q8, back, 8)
    assert computed >= len(q8.tokenizer.encode_prompts([str(s)])[0])  # every token recomputed (one prefill)
    assert str(ours) == str(_greedy(q8)(s.to_model(q8), max_tokens=8))


def test_damaged_kv_bytes_are_recomputed_and_a_truncated_file_is_refused(model, tmp_path, caplog):
    s = _greedy(model)("Lily and Tom", max_tokens=10)
    path = tmp_path / "s.safetensors"
    s.save(path)
    ref = str(_greedy(model)(s, max_tokens=8))

    def flip(tensors, meta):
        blob = tensors["kvh.blob0"]
        blob[-100] ^= 0xFF  # a value inside the cells, past the fingerprint header

    _rewrite(path, flip)
    with caplog.at_level(logging.WARNING, logger="continuum"):
        back = SequenceState.load(path, model)
    assert any("SHA-256" in r.getMessage() for r in caplog.records)
    assert kv.length(back._kv) == 0 and str(_greedy(model)(back, max_tokens=8)) == ref

    s.save(path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(StateFileError, match="not a readable continuum state file"):
        SequenceState.load(path, model)


def test_a_stores_resident_states_keep_their_kv_across_a_graceful_restart(model, tmp_path, caplog):
    """A server's store (serve/store.py) keeps a GGUF state's tokens in its parts; at shutdown the states in its memory
    are saved whole beside their parts (serve/sidecars.py). A store opened again on the folder loads such a state
    with its KV (its continuation computes only the new tokens, and equals the unsaved state's), consumes the file,
    and a sidecar goes with its part when the response is deleted; a sidecar from another GGUF is refused by its
    fingerprint and the state comes from its parts (recomputed)."""
    from continuum.serve.store import Store

    s = _greedy(model)("Once upon a time", max_tokens=12)
    want, _ = _continue(model, s)
    store = Store(tmp_path, model, memory_bytes=1 << 30, max_age=None, max_bytes=None)
    body = {"id": "r1", "object": "continuum.state", "created": 1.0}
    store.put("r1", "me", body, [], s)
    store.put("r2", "me", {**body, "id": "r2"}, [], _greedy(model)("The cat", max_tokens=3))
    assert store.save_resident() == 2 and store.save_resident() == 0  # (idempotent)
    store.close()

    reopened = Store(tmp_path, model, memory_bytes=1 << 30, max_age=None, max_bytes=None)  # (orphans kept: known)
    assert sorted(p.name for p in (tmp_path / "states").iterdir()) == ["r1.safetensors", "r1.safetensors.kv",
                                                                       "r2.safetensors", "r2.safetensors.kv"]
    loaded = reopened.state(reopened.get("r1", "me"))
    got, computed = _continue(model, loaded)
    assert computed == 10  # only the new tokens: the KV came back
    assert torch.equal(got.token_ids, want.token_ids)
    assert torch.equal(got.token_logprobs.nan_to_num(), want.token_logprobs.nan_to_num())
    assert not (tmp_path / "states" / "r1.safetensors.kv").exists()  # (consumed: the state is in memory again)
    assert reopened.delete("r2", "me") and not (tmp_path / "states" / "r2.safetensors.kv").exists()

    other = models.llamacpp(gguf("q8_0"), batch_invariant=True, n_threads=1)  # (another GGUF, same vocabulary)
    reopened.save_resident()
    reopened.close()
    third = Store(tmp_path, other, memory_bytes=1 << 30, max_age=None, max_bytes=None)
    with caplog.at_level(logging.WARNING, logger="continuum"):
        back = third.state(third.get("r1", "me"))
    assert back is not None and kv.length(back._kv) == 0 and list(back) == list(s)  # (its parts: tokens, recomputed)
    assert any("recompute" in r.getMessage() or "drop" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "states" / "r1.safetensors.kv").exists()
    third.close()
