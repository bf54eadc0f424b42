"""Any Hugging Face causal LM: tiny random models of many architectures, through the whole algebra.

Each must (1) match HF ``generate`` greedily token for token and (2) give, through a reused, sliced,
extended and beam-reordered cache, the logits of a fresh forward pass over the same tokens. The
families differ in position handling (learned with an offset, rotary variants, ALiBi), attention
layouts (GQA, parallel blocks, MoE) and caches; GPT-2 and Llama are covered everywhere else.
"""

from __future__ import annotations

import pytest
import torch

from continuum import continuous, generate, models, samplers

from conftest import _sharpen, assert_reuse_exact

ARCHITECTURES = {
    "qwen3": {},
    "phi3": {},
    "gemma": {"head_dim": 8},
    "gpt_neox": {"num_key_value_heads": None},
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "bloom": {"n_embed": 32, "n_layer": 2, "n_head": 4},
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32},
    "mixtral": {},
}
PROMPTS = ["Once upon a time there was", "Le café 🤗"]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_model(request, bpe_tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = bpe_tokenizer
    kwargs = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    kwargs.update(ARCHITECTURES[request.param])
    config = AutoConfig.for_model(request.param, **{k: v for k, v in kwargs.items() if v is not None})
    torch.manual_seed(0)
    return models.Transformers(_sharpen(AutoModelForCausalLM.from_config(config).eval()), tok)


def test_greedy_equals_hf_generate(arch_model):
    enc = arch_model.tokenizer.hf(PROMPTS[0], return_tensors="pt")
    ref = arch_model.model.generate(**enc, max_new_tokens=10, do_sample=False,
                                    pad_token_id=arch_model.tokenizer.pad_token_id)
    state = continuous(generate.text(arch_model, samplers.greedy()))(PROMPTS[0], max_tokens=10)
    assert state.token_ids[0].tolist() == ref[0].tolist()


def test_reused_cache_gives_fresh_logits(arch_model):
    g = continuous(generate.text(arch_model, samplers.greedy()))
    s = g(PROMPTS, max_tokens=8)
    cut = s[:, :12]
    states = [s, cut, g(cut + " and", max_tokens=4),
              continuous(generate.text(arch_model, samplers.beam_search(2)))(s, max_tokens=3)]
    for st in states:
        assert_reuse_exact(st)
