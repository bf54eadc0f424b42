"""``models.remote`` against ``continuum serve`` on a GGUF (llama.cpp), a real server process on loopback.

The client tokenizes with llama.cpp's own code over the GGUF's vocabulary, sent once as a vocab-only GGUF (the
metadata, no tensors): its fingerprint is the server's, and a program's ids, weights and log-probs equal the local
llama.cpp model's on the same file. Both sides run the batch-invariant mode (a call's result is what it gives alone,
exact on f32 files: docs/llamacpp.md), so the tolerance is the one docs/llamacpp.md states for a prefill against
itself on the stories260K fixtures, 1e-4; greedy ids are compared exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("llama_cpp")

from llamacpp_support import gguf

KEY = "remote-gguf-key"


@pytest.fixture(scope="module")
def path():
    return gguf("f32")


@pytest.fixture(scope="module")
def server(tmp_path_factory, path):
    from benchmarks import replicas

    os.environ["CONTINUUM_REMOTE_CACHE"] = str(tmp_path_factory.mktemp("remote-gguf-tokenizers"))
    srv = replicas.Server(str(path), tmp_path_factory.mktemp("remote-gguf") / "store", "--api-key", KEY,
                          "--threads", "1", "--batch-invariant", name="stories260K-gguf", key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def remote(server):
    from continuum import models

    return models.remote(server.base, api_key=KEY)


@pytest.fixture(scope="module")
def local(path):
    from continuum import models

    return models.llamacpp(path, n_threads=1, batch_invariant=True)


def same(a, b) -> None:
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.attention_masks, b.attention_masks)
    assert list(a) == list(b)
    assert torch.allclose(a.weights, b.weights, atol=1e-4)
    assert torch.allclose(a.token_logprobs, b.token_logprobs, atol=1e-4, equal_nan=True)
    assert a.value == b.value


def test_the_tokenizer_is_the_servers_llama_cpp_vocabulary(remote, local):
    from continuum.models.llamacpp.vocab import LlamaTokenizer

    tok = remote.tokenizer
    assert isinstance(tok, LlamaTokenizer)
    assert tok.fingerprint == local.tokenizer.fingerprint and tok.name == local.tokenizer.name
    texts = ["Once upon a time", " leading space", "naïve café — 猫\n\ttab", "<s> not special"]
    assert tok.encode_prompts(texts) == local.tokenizer.encode_prompts(texts)
    ids = local.tokenizer.encode_prompts(texts)[2]
    assert tok.decode(ids) == local.tokenizer.decode(ids)


def test_a_program_on_a_gguf_server_equals_the_local_llama_cpp_model(remote, local):
    from continuum import continuous, generate, samplers

    def run(model):
        story = continuous(generate.text(model, samplers.greedy()))
        mood = continuous(generate.choice(model, [" happy", " sad", " scared"]))
        age = continuous(generate.regex(model, r" [0-9]{1,2} years", samplers.greedy()))
        draws = continuous(generate.text(model, samplers.multinomial(2)))
        s1 = story("Once upon a time", max_tokens=12, stop_at=".")
        s2 = mood(s1 + " She was very")
        s3 = age(s2 + ". Lily was")
        s4 = story(s3[:len(str(s1))] + " One day,", max_tokens=8)  # a cut back, resumed on the server's KV
        s5 = draws(s4 + " Then", max_tokens=5, rng=torch.Generator().manual_seed(5))
        stream = story.stream(s5[0, :] + " and", max_tokens=6)
        chunks = list(stream)
        return [s1, s2, s3, s4, s5, stream.state], chunks

    before_r, before_l = remote.tokens_computed, local.tokens_computed
    (got, chunks), (want, chunks_local) = run(remote), run(local)
    for a, b in zip(got, want):
        same(a, b)
    assert chunks == chunks_local and len(chunks) > 1
    # the server's states in memory keep their llama.cpp cells: it computed what the local model did
    assert remote.tokens_computed - before_r == local.tokens_computed - before_l


def test_after_a_restart_a_handle_continues_from_the_stored_tokens(server, remote, local):
    """A GGUF server's store keeps a state's tokens, not its llama.cpp cells: after ``kill -9`` and a restart the
    handle is still good, and the server recomputes the tokens it covered (the same result, more positions)."""
    from continuum import continuous, generate, samplers

    text_r = continuous(generate.text(remote, samplers.greedy()))
    text_l = continuous(generate.text(local, samplers.greedy()))
    s = text_r("The little dog", max_tokens=8)
    server.kill9()
    server.start()
    before = remote.tokens_computed
    after = text_r(s + " He", max_tokens=5)
    same(after, text_l(text_l("The little dog", max_tokens=8) + " He", max_tokens=5))
    assert remote.tokens_computed - before >= len(s.token_ids[0])  # recomputed: the cells did not survive


def test_after_a_graceful_restart_a_handle_continues_with_its_cells(server, remote, local):
    """At a graceful shutdown (SIGTERM) the server saves the llama.cpp KV of the states in its memory beside their parts
    (serve/sidecars.py): after the restart the handle's state comes back with its cells, the call computes what the
    local model computes, and gives what it gives; the saved files are consumed."""
    from continuum import continuous, generate, samplers

    text_r = continuous(generate.text(remote, samplers.greedy()))
    text_l = continuous(generate.text(local, samplers.greedy()))
    s = text_r("The little dog", max_tokens=8)
    server.stop()
    assert list((server.store / "states").glob("*.kv"))  # (written at shutdown)
    server.start()
    before = remote.tokens_computed
    after = text_r(s + " He", max_tokens=5)
    s_l = text_l("The little dog", max_tokens=8)
    before_l = local.tokens_computed
    same(after, text_l(s_l + " He", max_tokens=5))
    assert remote.tokens_computed - before == local.tokens_computed - before_l  # continued, not recomputed
    assert not (server.store / "states" / f"{s._kv.entries[0][0]}.safetensors.kv").exists()  # (consumed)
