"""Models with sliding-window attention (Mistral-style: every layer; Qwen2/Gemma2-style: some layers).

The window is tiny (6 positions) so every test runs far beyond it. The adapter masks by position,
not by column, so holes left by slicing and padding never use up the window.
"""

from __future__ import annotations

import pytest
import torch

from continuum import continuous, generate, models, samplers

from conftest import _sharpen, assert_reuse_exact

WINDOW = 6
PROMPTS = ["Once upon a time there was", "Le café", "東京は 🤗 and more"]


@pytest.fixture(scope="module", params=["mistral", "qwen2-mixed", "gemma2"])
def sliding_model(request, spm_tokenizer):
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=len(spm_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=WINDOW,
                  bos_token_id=spm_tokenizer.bos_token_id, eos_token_id=spm_tokenizer.eos_token_id)
    if request.param == "mistral":
        hf = MistralForCausalLM(MistralConfig(**common))
    elif request.param == "qwen2-mixed":  # layer 0 full attention, layer 1 sliding
        hf = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, max_window_layers=1, **common))
        assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    else:  # sliding then full; eager attention (soft-capping), so the additive mask path
        hf = Gemma2ForCausalLM(Gemma2Config(head_dim=8, pad_token_id=spm_tokenizer.eos_token_id, **common))
        assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    return models.Transformers(_sharpen(hf.eval()), spm_tokenizer)


def test_greedy_equals_hf_generate_beyond_the_window(sliding_model):
    tok = sliding_model.tokenizer.hf
    for prompt in PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        ref = sliding_model.model.generate(**enc, max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id,
                                           eos_token_id=sliding_model.tokenizer.eos_token_id)
        state = continuous(generate.text(sliding_model, samplers.greedy()))(prompt, max_tokens=16)
        assert state.token_ids[0].tolist() == ref[0].tolist()
        assert state.token_ids.shape[1] > 2 * WINDOW


def test_batched_rows_equal_single_rows(sliding_model):
    gen = generate.text(sliding_model, samplers.greedy())
    assert gen(PROMPTS, max_tokens=12) == [gen(p, max_tokens=12) for p in PROMPTS]


def test_reuse_is_exact_after_slicing_adding_and_forking(sliding_model):
    g = continuous(generate.text(sliding_model, samplers.greedy()))
    s = g(PROMPTS, max_tokens=10)
    cut = s[:, :12]  # rows cut at different token counts: holes in the cached layout
    states = [s, cut, cut + " and then", g(cut + " and then", max_tokens=5),
              continuous(generate.text(sliding_model, samplers.multinomial(2)))(cut, max_tokens=4,
                                                                               rng=torch.Generator().manual_seed(0))]
    assert any(bool((st._mask[:, :st._kv.length()] == 0).any()) for st in states if st._kv)  # holes exist
    for st in states:
        assert_reuse_exact(st)
