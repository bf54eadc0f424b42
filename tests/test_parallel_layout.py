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
