"""A state moves between the transformers and llama.cpp backends when its token ids mean the same on both
(``ids_fingerprint``, continuum/models/idmap.py): stories260K as safetensors and as an f32 GGUF. The KV never moves
(another ``same_model``): the other model recomputes the ids in one prefill. References: llama-cpp-python's own
evaluation of the same ids (tolerances: tests/llamacpp_support.py) and transformers' ``generate``.
"""

from __future__ import annotations

import pytest
import torch
from test_llamacpp_backend import _check_greedy_path, _ids

from continuum import continuous, generate, models, samplers
from continuum.errors import TokenizerMismatch
from continuum.models import kv

from llamacpp_support import gguf


@pytest.fixture(scope="module")
def model():
    return models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=2)


def test_the_same_vocabulary_has_the_same_id_fingerprint_on_both_backends(model, stories):
    assert model.tokenizer.fingerprint != stories.tokenizer.fingerprint  # each hashes its own spelling of the tokens
    assert model.tokenizer.ids_fingerprint == stories.tokenizer.ids_fingerprint


def test_a_transformers_state_continues_on_llama_cpp_recomputed_in_one_prefill(model, stories):
    s = continuous(generate.text(stories, samplers.greedy()))("Once upon a time", max_tokens=16)
    ids = _ids(s)
    gen = continuous(generate.text(model, samplers.greedy()))
    before, calls = model.tokens_computed, model.forward_calls
    one = gen(s, max_tokens=1)
    assert model.tokens_computed - before == len(ids) and model.forward_calls - calls == 1  # every id once, one decode
    assert kv.opaque(one._kv) and kv.tensors(s._kv) is not None  # s untouched: its transformers tensors kept
    s2 = gen(s, max_tokens=16)
    assert _ids(s2)[:len(ids)] == ids and str(s2).startswith(str(s))
    _check_greedy_path(_ids(s2), len(ids))  # llama.cpp's own greedy continuation of the same ids
    moved = s.to_model(model)
    assert moved.model is model and moved._kv is None and torch.equal(moved.weights, s.weights)


def test_a_llama_cpp_state_continues_on_transformers_like_hf_generate(model, stories):
    s = continuous(generate.text(model, samplers.greedy()))("Lily went to the park", max_tokens=12)
    ids = _ids(s)
    before = stories.tokens_computed
    back = continuous(generate.text(stories, samplers.greedy()))(s, max_tokens=12)
    assert stories.tokens_computed - before <= len(ids) + 11  # one prefill of the ids, then one position per token
    ref = stories.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=12, do_sample=False)[0].tolist()
    ref = [t for t in ref if t not in stories.tokenizer.eos_token_ids]
    assert _ids(back) == ref


def test_a_different_vocabulary_is_still_refused(model, llama_model):
    s = continuous(generate.text(llama_model, samplers.greedy()))("Hello", max_tokens=3)
    assert llama_model.tokenizer.ids_fingerprint != model.tokenizer.ids_fingerprint
    with pytest.raises(TokenizerMismatch, match="from_prompts"):
        continuous(generate.text(model, samplers.greedy()))(s, max_tokens=3)
    with pytest.raises(TokenizerMismatch):
        s.to_model(model)


def test_a_state_file_loads_on_the_other_backend_recomputed(model, stories, tmp_path, caplog):
    s = continuous(generate.text(stories, samplers.greedy()))("Once upon a time", max_tokens=8)
    s.save(tmp_path / "hf.safetensors")
    with caplog.at_level("WARNING", logger="continuum"):
        back = type(s).load(tmp_path / "hf.safetensors", model)
    assert any("not this model" in r.getMessage() for r in caplog.records)  # the transformers KV is dropped
    assert back.model is model and kv.length(back._kv) == 0 and _ids(back) == _ids(s)
    gen = continuous(generate.text(model, samplers.greedy()))
    assert str(gen(back, max_tokens=8)) == str(gen(s, max_tokens=8))
    l_state = gen("Lily went to the park", max_tokens=6)
    l_state.save(tmp_path / "gguf.safetensors")
    caplog.clear()
    with caplog.at_level("WARNING", logger="continuum"):
        there = type(s).load(tmp_path / "gguf.safetensors", stories)
    assert any("another backend" in r.getMessage() or "not this model" in r.getMessage() for r in caplog.records)
    assert there.model is stories and _ids(there) == _ids(l_state)
