"""The other recurrent families transformers ships, on continuum's hybrid path (issue 44): Mamba-2, Granite 4,
Falcon-H1, Jamba, Qwen3-Next on tiny random models, and the families refused (see docs/hybrid.md). Apart from
``test_hybrid.py`` (whose LFM2 and Mamba tests run every state operation) because each family's first model costs
seconds of imports."""

from __future__ import annotations

import pytest
import torch

from hybrid_support import LFM2, PROMPTS, assert_exact, hf_greedy, ids_of, scaled

pytestmark = pytest.mark.skipif(not (LFM2 / "config.json").exists(), reason="lfm2-tiny fixture absent")

from continuum import continuous, generate
from continuum.errors import RecurrentStateError
from continuum.models import Transformers
from continuum.samplers import greedy


def _family_config(kind: str):
    """Tiny configs of the other recurrent families transformers ships (vocabulary of the LFM2 fixture)."""
    import transformers as T

    ids = dict(vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    common = dict(ids, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    mamba2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16)
    return {
        "mamba2": lambda: T.Mamba2Config(**ids, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=1,
                                         num_hidden_layers=2, expand=2, conv_kernel=4, chunk_size=16),
        "granitemoehybrid": lambda: T.GraniteMoeHybridConfig(**common, **mamba2, num_hidden_layers=2,
                                                             layer_types=["mamba", "attention"], num_local_experts=2,
                                                             num_experts_per_tok=1, shared_intermediate_size=64),
        "falcon_h1": lambda: T.FalconH1Config(**common, **mamba2, num_hidden_layers=2, mamba_d_ssm=128,
                                              mamba_expand=2, head_dim=16),
        "jamba": lambda: T.JambaConfig(**common, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                                       expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=8,
                                       mamba_d_conv=4, mamba_expand=2),
        "qwen3_next": lambda: T.Qwen3NextConfig(**common, num_hidden_layers=2, head_dim=16,
                                                layer_types=["linear_attention", "full_attention"],
                                                linear_num_value_heads=4, linear_num_key_heads=2,
                                                linear_key_head_dim=16, linear_value_head_dim=16,
                                                linear_conv_kernel_dim=4, num_experts=2, num_experts_per_tok=1,
                                                moe_intermediate_size=64, shared_expert_intermediate_size=64),
    }[kind]()


@pytest.mark.parametrize("kind", ["mamba2", "granitemoehybrid", "falcon_h1", "jamba", "qwen3_next"])
def test_other_recurrent_families(kind):
    """Mamba-2, Granite 4 (Mamba-2 + attention), Falcon-H1 (both in one layer), Jamba (Mamba + attention, continued
    token by token) and Qwen3-Next (gated DeltaNet + attention): greedy equals generate on a padded batch, continuing
    computes only new tokens, slicing stays exact (the rest runs the same code as LFM2's and Mamba's tests)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with torch.random.fork_rng():  # (a fixed initialisation without moving the global generator other tests draw from)
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(_family_config(kind)).eval()
    scaled(hf, 0)
    with torch.no_grad():
        hf.get_output_embeddings().weight[2] = 0  # no early </s>
    model = Transformers(hf, AutoTokenizer.from_pretrained(LFM2))
    assert model.hybrid is not None
    g = continuous(generate.text(model, greedy()))
    s = g(PROMPTS, max_tokens=4)
    for r, p in enumerate(PROMPTS):
        assert ids_of(s, r) == hf_greedy(model, model.tokenizer.encode_prompts([p])[0], 4)
    before = model.tokens_computed
    s2 = g(s, max_tokens=3)
    assert model.tokens_computed - before == 2 * 3
    assert_exact(model, s2[:, :len(list(s)[0]) + 2])  # (a cut between snapshots: recomputed from the one before)


def test_inconsistent_families_are_refused():
    """Zamba2 and Nemotron-H: transformers' one-token decode disagrees with its full forward, so they are refused."""
    import transformers as T

    cfg = T.Zamba2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, mamba_d_state=16, mamba_headdim=16, n_mamba_heads=8, mamba_ngroups=1,
                         chunk_size=16, layers_block_type=["mamba", "hybrid"], intermediate_size=128,
                         attention_head_dim=16)
    with pytest.raises(RecurrentStateError, match="zamba2"):
        Transformers(T.AutoModelForCausalLM.from_config(cfg), _tokenizer())


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(LFM2)
