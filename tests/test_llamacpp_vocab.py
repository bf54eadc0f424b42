"""The GGUF's own tokenizer (continuum.models.llamacpp.vocab) against llama-cpp-python's ``Llama.tokenize`` /
``detokenize`` and llama.cpp's own calls: ids, every token's bytes, round trips, end-of-generation ids, and the
outlines-core and llguidance views built from those bytes."""

from __future__ import annotations

import ctypes

import pytest

from continuum.errors import UnencodableTextError
from continuum.models.tokenizer import Tokenizer

from conftest import CORPUS
from llamacpp_support import gemma_path, llama_cpp, load, reference

TEXTS = sorted(set(CORPUS)) + ["", " ", "  leading spaces", "trailing  ", "a\n\nb", "<s> and </s> as text"]


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def kind(request):
    return request.param


def test_encode_matches_llama_cpp_python(kind):
    _, tok, _ = load(kind)
    ref = reference(kind)
    for text in TEXTS:
        assert tok.encode_prompts([text])[0] == ref.tokenize(text.encode(), add_bos=True, special=False), text
        assert tok.tokenize(text) == ref.tokenize(text.encode(), add_bos=False, special=False), text
    assert tok.bos_token_id == ref.token_bos() and tok.eos_token_id == ref.token_eos()
    assert tok.add_bos == (tok.encode_prompts(["x"])[0][0] == tok.bos_token_id)


def test_decode_matches_llama_cpp_python_and_round_trips(kind):
    _, tok, _ = load(kind)
    ref = reference(kind)
    for text in TEXTS:
        ids = tok.encode_prompts([text])[0]
        assert tok.decode(ids) == ref.detokenize(ids).decode("utf-8", errors="replace"), text
        assert tok.decode(ids) == text, text  # stories260K's vocabulary has byte fallback: every text round-trips
    assert tok.decode_batch([tok.encode_prompts([t])[0] for t in TEXTS]) == TEXTS


def test_token_bytes_match_llama_cpp(kind):
    _, tok, _ = load(kind)
    ref = reference(kind)
    L = llama_cpp.llama_cpp
    vocab = L.llama_model_get_vocab(ref.model)
    assert len(tok.vocab_bytes) == tok.n_vocab == ref.n_vocab()
    for i, data in enumerate(tok.vocab_bytes):
        attr = L.llama_vocab_get_attr(vocab, i)
        if attr & (L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_UNKNOWN | L.LLAMA_TOKEN_ATTR_UNUSED):
            assert data is None and i in tok.special_ids
        else:
            assert data == ref.detokenize([i]) and data, i  # llama-cpp-python's 32-byte buffer suffices here
    assert tok.byte_fallback_ids == frozenset(i for i in range(tok.n_vocab)
                                              if L.llama_vocab_get_attr(vocab, i) & L.LLAMA_TOKEN_ATTR_BYTE)
    assert len(tok.byte_fallback_ids) == 256
    ids = tok.encode_prompts(["héllo wörld 🦙"])[0]
    assert tok.byte_offsets(ids)[-1] == len("héllo wörld 🦙".encode()) + (1 if tok.add_space_prefix else 0)


def test_continuations_decode_to_the_joined_text(kind):
    _, tok, _ = load(kind)
    for head, tail in [("Once upon a", " time"), ("The dog", "gy"), ("x", "\n\nnew line"), ("café", " crème 🤗")]:
        ids = tok.encode_prompts([head])[0] + tok.encode_continuation(tail)
        assert tok.decode(ids) == head + tail
    assert tok.encode_continuations(["", " a"]) == [[], tok.encode_continuation(" a")]
    with pytest.raises(UnencodableTextError, match="surrogate"):
        tok.encode_continuation("bad \ud800")
    with pytest.raises(UnencodableTextError):
        tok.encode_prompts(["ok", "bad \udfff"])


def test_special_tokens_are_parsed_only_on_request():
    _, tok, _ = load("f32")
    text = "<s>"
    assert tok.bos_token_id not in tok.tokenize(text)
    assert tok.tokenize(text, parse_special=True) == [tok.bos_token_id]


def test_end_of_generation_ids(kind):
    _, tok, _ = load(kind)
    L = llama_cpp.llama_cpp
    vocab = L.llama_model_get_vocab(reference(kind).model)
    assert tok.eos_token_ids == frozenset(i for i in range(tok.n_vocab) if L.llama_vocab_is_eog(vocab, i))
    assert tok.eos_token_id in tok.eos_token_ids and tok.pad_token_id is not None


def test_same_interface_as_the_transformers_tokenizer():
    _, tok, _ = load("f32")
    public = {n for n in dir(Tokenizer) if not n.startswith("_")} - {"hf"}
    missing = [n for n in public if not hasattr(tok, n)]
    assert not missing, missing
    assert len(tok.fingerprint) == 16 and tok.fingerprint == load("f32")[1].fingerprint


def test_outlines_vocabulary_from_bytes():
    _, tok, _ = load("f32")
    voc = tok.vocabulary
    assert voc.get_eos_token_id() == tok.eos_token_id
    for i in (tok.encode_continuation(" the") + tok.encode_continuation(" upon")):
        assert i in voc.get(tok.vocab_bytes[i])
    assert tok.vocabulary is voc  # built once


def test_llguidance_tokenizer_is_llama_cpps():
    _, tok, _ = load("f32")
    llg = tok.llg_tokenizer
    assert tok.llg_tokenizer is llg
    for text in TEXTS[:8]:
        assert llg.tokenize_str(text) == tok.encode_continuation(text)  # llguidance strips the space prefix too
    assert llg.eos_token == tok.eos_token_id or set(getattr(llg, "eos_tokens", [llg.eos_token])) <= tok.eos_token_ids


@pytest.mark.slow
def test_gemma3_long_pieces_and_end_of_turn():
    """Gemma 3: pieces up to 48 bytes (379 over llama-cpp-python's 32), EOG ids <eos> and <end_of_turn>."""
    path = gemma_path()
    _, tok, _ = load("gemma", n_seq_max=4)
    assert path.exists()
    lengths = [len(b) for b in tok.vocab_bytes if b]
    assert max(lengths) == 48 and sum(n > 32 for n in lengths) == 379
    L = llama_cpp.llama_cpp
    buf = ctypes.create_string_buffer(256)
    longest = max(range(tok.n_vocab), key=lambda i: len(tok.vocab_bytes[i] or b""))
    n = L.llama_token_to_piece(tok.model.vocab_ptr, longest, buf, 256, 0, False)
    assert tok.vocab_bytes[longest] == buf.raw[:n]
    assert {1, 106} <= tok.eos_token_ids
    assert tok.decode(tok.encode_prompts(["Hello <end_of_turn> world"])[0]) == "Hello <end_of_turn> world"
    assert 106 in tok.encode_prompts(["<start_of_turn>user\nHi<end_of_turn>"], parse_special=True)[0]
