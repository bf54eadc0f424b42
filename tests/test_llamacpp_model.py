"""The llama.cpp backend's model: a GGUF loads with its one context; bad paths, non-GGUF files and bad settings are
refused with a ModelLoadError within seconds (never a crash or a raw llama.cpp error)."""

from __future__ import annotations

import time

import pytest

from continuum.errors import ModelLoadError
from continuum.models.llamacpp import LlamaCppModel

from llamacpp_support import gguf, llama_cpp, load, reference


def test_loads_what_llama_cpp_python_reads():
    model, _, _ = load("f32")
    ref = reference("f32")
    assert model.n_vocab == ref.n_vocab()
    assert model.n_ctx_train == ref._model.n_ctx_train()
    assert model.context_length == min(model.n_ctx_train, model.n_ctx)
    assert model.n_swa == 0 and not model.is_sliding
    assert model.n_seq_max == 256 and model.n_batch >= model.n_seq_max
    assert model.architecture == "llama"
    assert model.metadata("general.architecture") == "llama" and model.metadata("no.such.key") is None
    assert model.n_threads == 2 and "stories260K-f32.gguf" in repr(model)


@pytest.mark.parametrize("make, match", [
    (lambda tmp: tmp / "missing.gguf", "no GGUF file"),
    (lambda tmp: tmp, "is a directory"),
    (lambda tmp: _write(tmp / "model.safetensors", b'{"__metadata__": {}}' + b"\0" * 64), "not a GGUF file"),
    (lambda tmp: _write(tmp / "empty.gguf", b""), "not a GGUF file"),
    (lambda tmp: _write(tmp / "cut.gguf", gguf("f32").read_bytes()[:4096]), "could not load"),
    (lambda tmp: _write(tmp / "junk.gguf", b"GGUF" + b"\xff" * 4096), "could not load"),
])
def test_bad_paths_are_refused_quickly(tmp_path, make, match):
    path = make(tmp_path)
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=match):
        LlamaCppModel(path, n_threads=1)
    assert time.monotonic() - start < 10


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("kwargs, match", [
    ({"n_seq_max": 0}, "n_seq_max"),
    ({"n_seq_max": 257}, "n_seq_max"),
    ({"n_batch": 8}, "n_batch"),
    ({"kv_type": "q4"}, "kv_type"),
    ({"kv_type": "q8_0", "flash_attn": False}, "flash_attn=True"),
    ({"n_ctx": -1}, "n_ctx"),
    ({"n_threads": True}, "n_threads"),
    ({"n_ctx": 64}, "below n_seq_max"),  # (llama.cpp aborted the process: its batch must hold n_seq_max outputs)
    ({"n_ctx": 200, "n_seq_max": 256}, "below n_seq_max"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ModelLoadError, match=match):
        LlamaCppModel(gguf("f32"), **kwargs)


def test_close_frees_and_later_use_is_an_error():
    model = LlamaCppModel(gguf("q8_0"), n_threads=1, n_seq_max=4)
    assert model.ctx
    model.close()
    model.close()  # twice is fine
    with pytest.raises(ModelLoadError, match="closed"):
        model.ctx


def test_version_is_recorded():
    from continuum.models.llamacpp.fingerprint import fingerprint_of

    model, _, _ = load("f32")
    assert fingerprint_of(model).llama_cpp == llama_cpp.__version__


def test_the_default_pool_is_the_training_context_within_memory():
    """Without n_ctx: the model's training context (at least 4096 cells), cut to what a quarter of the available
    memory holds; the repr says which, and the cell size comes from the file's attention shape (stories260K: 5 layers,
    4 KV heads of 8, f16: 640 bytes)."""
    from continuum.models.llamacpp.model import default_n_ctx

    model, _, _ = load("f32")
    assert model.kv_bytes_per_cell() == 5 * 4 * (8 + 8) * 2 and model.kv_bytes_per_cell("f32") == 1280
    assert model.n_ctx == 4096 and "(at least 4096)" in repr(model)
    assert default_n_ctx(32768, None, 256) == (32768, "the model's training context")
    assert default_n_ctx(32768, 1 << 40, 256) == (256, "a quarter of the memory available")  # (no room: the floor)
