"""Parallel layouts in one process: loading errors for ``tp_plan``, the layout in the model identity,
save/load across layouts, and ``device_map`` (each layer's KV cache on its layer's device).

What needs several processes (tensor parallelism under torchrun) is in ``test_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_spm_tokenizer, tiny_llama

from continuum import ContinuumError, models
from continuum.errors import ModelLoadError


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama (4 heads, 2 key/value heads) and its tokenizer saved as a checkpoint folder."""
    tok = make_spm_tokenizer()
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------- loading errors
def test_tp_plan_without_torchrun_says_how_to_launch(llama_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ModelLoadError, match=r"torchrun --nproc-per-node N") as info:
        models.transformers(llama_dir, tp_plan="auto")
    assert isinstance(info.value, ContinuumError) and isinstance(info.value, ValueError)
    assert models.transformers(llama_dir).model.config.num_attention_heads == 4  # nothing broken: loads without it


def test_heads_not_divisible_by_world_size(llama_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # what torchrun --nproc-per-node 3 sets, before any process group
    with pytest.raises(ModelLoadError, match=r"4 attention heads and 2 key/value heads.*3 processes.*\[1, 2\]"):
        models.transformers(llama_dir, tp_plan="auto")


@pytest.mark.parametrize("kwargs, match", [
    ({"tp_plan": "auto", "device_map": "cpu"}, "exclusive"),
    ({"device_map": "cpu", "device": "cpu"}, "drop device="),
])
def test_conflicting_placements(llama_dir, monkeypatch, kwargs, match):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ModelLoadError, match=match):
        models.transformers(llama_dir, **kwargs)


def test_missing_checkpoint_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="Could not load"):
        models.transformers(str(tmp_path / "nowhere"))


# ---------------------------------------------------------------- the layout in the model identity, save/load
def _greedy(model):
    from continuum import continuous, generate, samplers

    return continuous(generate.text(model, samplers.greedy()))


def _rewrite_layout(src, dst, **layout):
    """A copy of a saved state whose recorded model identity has another layout (or none, when ``layout``
    maps keys to None: a file saved before layouts were recorded)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta = json.loads(f.metadata()["continuum"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for key, value in layout.items():
        if value is None:
            meta["model"].pop(key, None)
        else:
            meta["model"][key] = value
    save_file(tensors, str(dst), metadata={"continuum": json.dumps(meta)})


def test_single_process_fingerprint_records_its_layout(llama_model):
    fp = llama_model.fingerprint
    assert (fp.world_size, fp.rank, fp.tp_plan) == (1, 0, None) and fp.layout == "single process"
    assert fp.as_dict()["world_size"] == 1


def test_state_saved_by_a_tp_rank_is_recomputed_in_one_process(llama_model, tmp_path, caplog):
    import logging

    from continuum import SequenceState

    s = _greedy(llama_model)(["Once upon a time", "The dog"], max_tokens=5)
    s.save(tmp_path / "s.safetensors")
    # what rank 1 of a 2-process run writes: same architecture, config and (here) weights hash, another layout
    _rewrite_layout(tmp_path / "s.safetensors", tmp_path / "rank1.safetensors", world_size=2, rank=1, tp_plan="auto:0")
    with caplog.at_level(logging.WARNING, logger="continuum"):
        loaded = SequenceState.load(tmp_path / "rank1.safetensors", llama_model)
    messages = [r.getMessage() for r in caplog.records if r.name == "continuum"]
    assert any("cache is dropped" in m and "rank 1 of 2" in m for m in messages)
    assert int(loaded.cached_tokens.sum()) == 0 and list(loaded) == list(s) and torch.equal(loaded.weights, s.weights)
    expected = _greedy(llama_model)(s, max_tokens=4)
    out = _greedy(llama_model)(loaded, max_tokens=4)
    assert list(out) == list(expected)
    torch.testing.assert_close(out.weights, expected.weights, atol=1e-4, rtol=0)


def test_files_without_a_layout_are_single_process(llama_model, tmp_path, caplog):
    import logging

    from continuum import SequenceState

    s = _greedy(llama_model)("Once upon a time", max_tokens=5)
    s.save(tmp_path / "s.safetensors")
    _rewrite_layout(tmp_path / "s.safetensors", tmp_path / "old.safetensors", world_size=None, rank=None, tp_plan=None)
    with caplog.at_level(logging.WARNING, logger="continuum"):
        loaded = SequenceState.load(tmp_path / "old.safetensors", llama_model)
    assert not [r for r in caplog.records if r.name == "continuum"]
    assert torch.equal(loaded.cached_tokens, s.cached_tokens) and int(loaded.cached_tokens.min()) > 0
