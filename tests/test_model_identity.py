"""A state of one model used with another: fingerprints, ``to_model``, continuing, save/load, +/stack, dtype/device.

The reference is always what the generator's model computes from scratch on the same token ids
(an HF forward of that model), never the first model's cache.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from continuum import ModelMismatch, SequenceState, TokenizerMismatch, continuous, generate, models, samplers
from continuum.errors import GeneratorArgumentError

from conftest import _sharpen, count_forward_tokens, kv_layers, next_logits_fresh, next_logits_via_cache, tiny_llama


@pytest.fixture(scope="module")
def pair(spm_tokenizer):
    """Two tiny Llamas with the same tokenizer and config, different seeds (a base and a fine-tune)."""
    tok = spm_tokenizer

    def make(seed):
        hf = _sharpen(tiny_llama(len(tok), seed=seed, bos=tok.bos_token_id, eos=tok.eos_token_id))
        return models.Transformers(hf, tok)

    return make(0), make(1)


def greedy_c(model):
    return continuous(generate.text(model, samplers.greedy()))


def reference_greedy(model, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of ``model`` from scratch: a full HF forward per step, stopping at EOS."""
    out = list(ids)
    eos = model.tokenizer.eos_token_ids
    with torch.no_grad():
        for _ in range(max_tokens):
            nxt = int(model.model(input_ids=torch.tensor([out], device=model.device)).logits[0, -1].argmax())
            if nxt in eos:
                break
            out.append(nxt)
    return out[len(ids):]


def real_ids(state) -> list[list[int]]:
    return [ids for ids, _ in state._real_rows()]


def snapshot(state):
    kv = [(k.clone(), v.clone()) for k, v in kv_layers(state)]
    return state._ids.clone(), state._mask.clone(), state._weights.clone(), kv, list(state)


def assert_unchanged(state, snap):
    ids, mask, weights, kv, texts = snap
    assert torch.equal(state._ids, ids) and torch.equal(state._mask, mask) and torch.equal(state._weights, weights)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv_layers(state), kv))
    assert list(state) == texts


# ---------------------------------------------------------------------------------------- identity
def test_fingerprint_tells_models_apart(pair, spm_tokenizer):
    a, b = pair
    fa, fb = a.fingerprint, b.fingerprint
    assert fa.architecture == fb.architecture == "LlamaForCausalLM"
    assert fa.config == fb.config and fa.weights != fb.weights
    # the same weights built again (another object, another path) are the same model
    again = models.Transformers(_sharpen(tiny_llama(len(spm_tokenizer), seed=0, bos=spm_tokenizer.bos_token_id,
                                                     eos=spm_tokenizer.eos_token_id)), spm_tokenizer)
    again.model.config._name_or_path = "somewhere/else"
    assert again.fingerprint == fa and again.same_model(a) and not b.same_model(a)
    # one changed element of the last layer's weights (a fine-tune) changes the fingerprint
    tuned = copy.deepcopy(a.model)
    with torch.no_grad():
        tuned.model.layers[-1].mlp.down_proj.weight[0, 0] += 1e-3
    assert models.Transformers(tuned, spm_tokenizer).fingerprint.weights != fa.weights
    # another config (one more layer) changes the config hash
    cfg = copy.deepcopy(a.model.config)
    cfg.num_hidden_layers = 3
    from transformers import LlamaForCausalLM
    assert models.Transformers(LlamaForCausalLM(cfg), spm_tokenizer).fingerprint.config != fa.config


def test_same_adapter_is_instant(spm_tokenizer, pair):
    fresh = models.Transformers(pair[0].model, spm_tokenizer)
    assert fresh.same_model(fresh) and fresh.same_model(pair[0])  # same module: no hashing either
    assert "fingerprint" not in fresh.__dict__
    assert not fresh.same_model("not a model")


# ---------------------------------------------------------------------------------------- continuing on another model
@pytest.mark.parametrize("method", ["text", "choice"])
def test_continue_state_of_a_on_b_equals_b_from_scratch(pair, method):
    a, b = pair
    sa = greedy_c(a)(["Once upon a time", "The quick brown fox jumps"], max_tokens=6)
    sa = sa[:, :-3]  # rows cut at different places: holes in the private layout, partial caches
    before = greedy_c(a)(sa, max_tokens=5)
    snap = snapshot(sa)
    # B's logits over A's tokens, computed in one pass of B, equal B's fresh forward
    sb = sa.to_model(b)
    assert sb.model is b and sb._kv is None and real_ids(sb) == real_ids(sa)
    assert torch.equal(sb.weights, sa.weights) and list(sb) == list(sa)
    torch.testing.assert_close(next_logits_via_cache(sb), next_logits_fresh(sb), atol=1e-4, rtol=0)
    calls0, tokens0 = b.forward_calls, b.tokens_computed
    if method == "text":
        out = greedy_c(b)(sa, max_tokens=5)
        calls, rows, width = b.forward_calls - calls0, sb.rows, sb._ids.shape[1]
        assert calls <= 5  # all of A's tokens in ONE forward of B, then one column per new token
        assert b.tokens_computed - tokens0 == rows * width + rows * (calls - 1)
        for row, ids in enumerate(real_ids(sa)):
            assert real_ids(out)[row][len(ids):] == reference_greedy(b, ids, 5)
    else:
        options = [" there", " a little", " dog"]
        out = continuous(generate.choice(b, options, samplers.greedy()))(sa)
        assert b.forward_calls - calls0 == 1  # A's tokens and all (row, option) pairs in ONE forward (the trees' trunk)
        for row, ids in enumerate(real_ids(sa)):  # B's option log-probs, from scratch
            gains = []
            for o in options:
                opt = b.tokenizer.encode_continuation(o)
                with torch.no_grad():
                    lp = torch.log_softmax(b.model(input_ids=torch.tensor([ids + opt])).logits[0].float(), -1)
                gains.append(sum(float(lp[len(ids) - 1 + j, t]) for j, t in enumerate(opt)))
            best = max(range(len(options)), key=gains.__getitem__)
            assert out.value[row] == options[best]
            assert float(out.weights[row, 0] - sa.weights[row, 0]) == pytest.approx(gains[best], abs=1e-4)
    # A's state is untouched and still continues on A exactly as before
    assert_unchanged(sa, snap)
    after = greedy_c(a)(sa, max_tokens=5)
    assert list(after) == list(before) and torch.equal(after.weights, before.weights)


def test_to_model_same_model_keeps_the_state(pair, spm_tokenizer):
    a, _ = pair
    s = greedy_c(a)("Once upon a time", max_tokens=4)
    assert s.to_model(a) is s
    other_adapter = models.Transformers(a.model, spm_tokenizer)  # same weights, another adapter
    moved = s.to_model(other_adapter)
    assert moved.model is other_adapter and moved._kv is s._kv
    with pytest.raises(TypeError, match="continuum model"):
        s.to_model(a.model)


def test_other_tokenizer_is_a_clear_error(gpt2_model, llama_model):
    s = greedy_c(llama_model)("Once upon a time", max_tokens=3)
    expected = list(greedy_c(llama_model)(s, max_tokens=3))
    with pytest.raises(TokenizerMismatch, match=r"from_prompts\(model, list\(state\)\)") as err:
        greedy_c(gpt2_model)(s, max_tokens=3)
    assert isinstance(err.value, GeneratorArgumentError) and isinstance(err.value, ValueError)
    with pytest.raises(TokenizerMismatch):
        s.to_model(gpt2_model)
    # the suggested fix works, and the input is still usable
    assert list(greedy_c(gpt2_model)(SequenceState.from_prompts(gpt2_model, list(s)), max_tokens=2))
    assert list(greedy_c(llama_model)(s, max_tokens=3)) == expected


# ---------------------------------------------------------------------------------------- save / load
def test_load_into_another_model_drops_cache_and_warns(pair, tmp_path, caplog):
    a, b = pair
    s = greedy_c(a)(["Once upon a time", "The dog"], max_tokens=5)
    s.save(tmp_path / "s.safetensors")
    with caplog.at_level(logging.WARNING, logger="continuum"):
        loaded = SequenceState.load(tmp_path / "s.safetensors", b)
    assert any("cache is dropped" in r.getMessage() for r in caplog.records if r.name == "continuum")
    assert loaded.model is b and int(loaded.cached_tokens.sum()) == 0
    assert real_ids(loaded) == real_ids(s) and torch.equal(loaded.weights, s.weights)
    assert torch.equal(loaded.token_logprobs.nan_to_num(), s.token_logprobs.nan_to_num()) and loaded.value == s.value
    out = greedy_c(b)(loaded, max_tokens=4)
    for row, ids in enumerate(real_ids(s)):
        assert real_ids(out)[row][len(ids):] == reference_greedy(b, ids, 4)
    torch.testing.assert_close(next_logits_via_cache(loaded), next_logits_fresh(loaded), atol=1e-4, rtol=0)


def test_load_into_same_model_keeps_cache(pair, tmp_path, caplog):
    a, _ = pair
    s = greedy_c(a)(["Once upon a time", "The dog"], max_tokens=5)
    expected = greedy_c(a)(s, max_tokens=4)
    s.save(tmp_path / "s.safetensors")
    with caplog.at_level(logging.WARNING, logger="continuum"):
        loaded = SequenceState.load(tmp_path / "s.safetensors", a)
    assert not [r for r in caplog.records if r.name == "continuum"]
    assert torch.equal(loaded.cached_tokens, s.cached_tokens) and int(loaded.cached_tokens.min()) > 0
    counter, handle = count_forward_tokens(a)
    try:
        out = greedy_c(a)(loaded, max_tokens=4)
    finally:
        handle.remove()
    # nothing cached is recomputed: the uncached suffix (one token per row) once, then one column per step
    suffix = loaded._ids.shape[1] - loaded._kv.length()
    assert counter["calls"] <= 4 and counter["tokens"] == 2 * (suffix + counter["calls"] - 1)
    assert list(out) == list(expected) and torch.equal(out.weights, expected.weights)


def test_load_old_format_drops_cache(pair, tmp_path, caplog):
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    a, _ = pair
    s = greedy_c(a)("Once upon a time", max_tokens=5)
    s.save(tmp_path / "new.safetensors")
    with safe_open(str(tmp_path / "new.safetensors"), framework="pt") as f:  # rewrite as a format-1 file
        meta = json.loads(f.metadata()["continuum"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    meta["format"] = 1
    del meta["model"]
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata={"continuum": json.dumps(meta)})
    with caplog.at_level(logging.WARNING, logger="continuum"):
        old = SequenceState.load(tmp_path / "old.safetensors", a)
    assert any("unknown model" in r.getMessage() for r in caplog.records)
    assert int(old.cached_tokens.sum()) == 0 and real_ids(old) == real_ids(s)
    assert list(greedy_c(a)(old, max_tokens=4)) == list(greedy_c(a)(s, max_tokens=4))


# ---------------------------------------------------------------------------------------- + and stack
def test_add_and_stack_states_of_different_models(pair, gpt2_model):
    a, b = pair
    sa = greedy_c(a)("Once upon a time", max_tokens=4)
    sb = greedy_c(b)("The dog", max_tokens=4)
    snaps = snapshot(sa), snapshot(sb)
    for attempt in (lambda: sa + sb, lambda: SequenceState.stack([sa, sb]), lambda: greedy_c(a)([sa, sb], max_tokens=2)):
        with pytest.raises(ModelMismatch, match=r"to_model\(") as err:
            attempt()
        assert isinstance(err.value, ValueError)
    gs = greedy_c(gpt2_model)("Once", max_tokens=2)
    for attempt in (lambda: sa + gs, lambda: SequenceState.stack([sa, gs])):
        with pytest.raises(TokenizerMismatch, match="tokenizer"):
            attempt()
    assert_unchanged(sa, snaps[0])
    assert_unchanged(sb, snaps[1])
    # the suggested conversion works: A's cache kept, B's part recomputed by A in one pass
    both = SequenceState.stack([sa, sb.to_model(a)])
    assert both.cached_tokens[0, 0] == sa.cached_tokens[0, 0] and both.cached_tokens[1, 0] == 0
    out = greedy_c(a)(both, max_tokens=3)
    for row, ids in enumerate(real_ids(both)):
        assert real_ids(out)[row][len(ids):] == reference_greedy(a, ids, 3)
    assert list(sa + sb.to_model(a)) == [sa.texts[0] + sb.texts[0]]


# ---------------------------------------------------------------------------------------- dtype / device
def test_state_after_model_dtype_change_is_recomputed(spm_tokenizer, caplog):
    tok = spm_tokenizer
    m = models.Transformers(_sharpen(tiny_llama(len(tok), seed=3, bos=tok.bos_token_id, eos=tok.eos_token_id)), tok)
    s = greedy_c(m)(["Once upon a time", "The dog"], max_tokens=4)
    snap = snapshot(s)
    m.model.double()
    with caplog.at_level(logging.WARNING, logger="continuum"):
        converted = s.to_model(m)
    assert any("dtype changed" in r.getMessage() for r in caplog.records)
    assert converted._kv is None and real_ids(converted) == real_ids(s)
    calls = m.forward_calls
    out = greedy_c(m)(s, max_tokens=4)
    assert out._kv.dtype() == torch.float64
    for row, ids in enumerate(real_ids(s)):
        assert real_ids(out)[row][len(ids):] == reference_greedy(m, ids, 4)
    assert m.forward_calls - calls <= 4
    torch.testing.assert_close(next_logits_via_cache(out).double(), next_logits_fresh(out).double(), atol=1e-4, rtol=0)
    assert_unchanged(s, snap)  # the float32 state itself is untouched
    # stacking a float32 state with a float64 one recomputes only the float32 one
    stacked = SequenceState.stack([s, out])
    assert stacked._kv.dtype() == torch.float64 and stacked.cached_tokens[2:].min() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_state_after_model_device_change_is_moved(spm_tokenizer):  # pragma: no cover - GPU machines only
    tok = spm_tokenizer
    m = models.Transformers(_sharpen(tiny_llama(len(tok), seed=4, bos=tok.bos_token_id, eos=tok.eos_token_id)), tok)
    s = greedy_c(m)("Once upon a time", max_tokens=4)
    m.model.to("cuda")
    moved = s.to_model(m)
    assert moved._ids.device.type == "cuda" and moved._kv.tensors()[0][0].device.type == "cuda"
    assert torch.equal(moved.cached_tokens, s.cached_tokens)
    out = greedy_c(m)(s, max_tokens=4)
    assert real_ids(out)[0][len(real_ids(s)[0]):] == reference_greedy(m, real_ids(s)[0], 4)
