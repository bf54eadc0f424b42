"""A tiny sliding-window GGUF written at test time: Gemma 3's architecture (five sliding-window layers, then one over
every token, llama.cpp's own pattern for it) with random weights, a window of 8 tokens and stories260K's 512-token
SentencePiece vocabulary (copied from its GGUF). The real Gemma 3 270M has a 512-token window, which the tests' short
states never outgrow; here they outgrow it many times, so llama.cpp's two caches (the window's and the full one) and
continuum's window handling (``continuum/models/llamacpp/window.py``) are exercised on every history. Its reference is
llama.cpp's own evaluation of the same file (the weights mean nothing: exactness is the point, never quality).
"""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES

WINDOW = 8  # tokens: the sliding window of layers 0-4 (layer 5 attends to every token)
SHARP = 8  # the output projection's scale: peaked but varied distributions (greedy margins clear of the noise)
_VOCAB_FIELDS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                 "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                 "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")


@cache
def window_gguf() -> Path:
    """The file (written once per test process; skipped without the ``gguf`` package or stories260K's GGUF)."""
    gguf = pytest.importorskip("gguf")
    source = FIXTURES / "models" / "stories260K-gguf" / "stories260K-f32.gguf"
    if not source.exists():
        pytest.skip(f"fixture {source} not available")
    path = Path(tempfile.mkdtemp(prefix="continuum-window-gguf-")) / "gemma3-window8-f32.gguf"
    reader = gguf.GGUFReader(str(source))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    embd, ff, heads, kv_heads, head_dim, layers = 64, 128, 4, 1, 16, 6
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny gemma3 window 8 (random)")
    w.add_context_length(512)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(WINDOW)
    w.add_file_type(0)  # all f32
    for name in _VOCAB_FIELDS:
        field = reader.fields[name]
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(name, field.contents())
        else:
            w.add_key_value(name, field.contents(), kind)
    rng = np.random.default_rng(0)

    def weight(*shape: int, scale: float = 1.0) -> np.ndarray:  # (numpy's shape: llama.cpp's dims reversed)
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    ones = lambda n: np.ones(n, np.float32)  # noqa: E731  (Gemma's GGUF norms hold 1 + weight: plain scaling)
    w.add_tensor("token_embd.weight", weight(vocab, embd))
    w.add_tensor("output.weight", weight(vocab, embd, scale=float(SHARP)))
    w.add_tensor("output_norm.weight", ones(embd))
    for i in range(layers):
        p = f"blk.{i}."
        for name, t in (("attn_norm", ones(embd)), ("attn_q", weight(heads * head_dim, embd)),
                        ("attn_k", weight(kv_heads * head_dim, embd)), ("attn_v", weight(kv_heads * head_dim, embd)),
                        ("attn_output", weight(embd, heads * head_dim)), ("attn_q_norm", ones(head_dim)),
                        ("attn_k_norm", ones(head_dim)), ("post_attention_norm", ones(embd)), ("ffn_norm", ones(embd)),
                        ("ffn_gate", weight(ff, embd)), ("ffn_up", weight(ff, embd)), ("ffn_down", weight(embd, ff)),
                        ("post_ffw_norm", ones(embd))):
            w.add_tensor(p + name + ".weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
