"""A GGUF server's tokenizer on the client: the GGUF's metadata without its tensors (a vocab-only GGUF, as llama.cpp's
own ``ggml-vocab-*.gguf`` files are), loaded by llama.cpp with ``vocab_only`` under continuum's
:class:`~continuum.models.llamacpp.vocab.LlamaTokenizer`: the same code over the same vocabulary as the server's, so
its fingerprint, encodings, decodings and compiled constraints are the server's.

The file is the GGUF's header and key-value section as they are, with no tensors (a few hundred KB for a 262k
vocabulary; the weights never travel). The client needs llama-cpp-python, as for a local GGUF.
"""

from __future__ import annotations

import struct
import threading
import weakref
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError, RemoteError

__all__ = ["vocab_only", "VocabOnlyModel", "load_gguf_tokenizer"]


_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF's fixed-size value types
_STRING, _ARRAY = 8, 9


def vocab_only(path: str | Path) -> bytes:
    """The GGUF at ``path`` as a vocab-only GGUF: its header with no tensors, and every metadata key-value (read
    as bytes, up to the first tensor's description: the weights are never read)."""
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file")
        version, _tensors, n_kv = struct.unpack("<IQQ", head[4:])
        if version < 2:
            raise ModelLoadError(f"{path}: GGUF version {version} is older than llama.cpp reads")

        def take(n: int) -> bytes:
            data = f.read(n)
            if len(data) != n:
                raise ModelLoadError(f"{path} is truncated inside its metadata")
            return data

        def skip_value(kind: int) -> None:
            if kind == _STRING:
                take(struct.unpack("<Q", take(8))[0])
            elif kind == _ARRAY:
                inner, count = struct.unpack("<IQ", take(12))
                if inner in _SIZES:
                    take(_SIZES[inner] * count)
                else:
                    for _ in range(count):
                        skip_value(inner)
            elif kind in _SIZES:
                take(_SIZES[kind])
            else:
                raise ModelLoadError(f"{path}: unknown GGUF value type {kind}")

        alignment = 32
        for _ in range(n_kv):
            key = take(struct.unpack("<Q", take(8))[0])
            kind = struct.unpack("<I", take(4))[0]
            if key == b"general.alignment" and kind == 4:
                alignment = struct.unpack("<I", take(4))[0]
            else:
                skip_value(kind)
        end = f.tell()
        f.seek(24)
        body = b"GGUF" + struct.pack("<IQQ", version, 0, n_kv) + f.read(end - 24)
    return body + b"\0" * (-len(body) % alignment)


class VocabOnlyModel:
    """What :class:`LlamaTokenizer` reads of a model (its vocabulary, metadata, path), from a vocab-only GGUF."""

    def __init__(self, path: str | Path):
        from ..llamacpp._lib import lib

        L = lib()
        self.path = Path(path)
        self.lock = threading.RLock()
        params = L.llama_model_default_params()
        params.n_gpu_layers, params.vocab_only = 0, True
        with self.lock:
            model = L.llama_model_load_from_file(str(self.path).encode(), params)
        if not model:
            raise RemoteError(f"llama.cpp could not load the vocabulary sent by the server ({self.path}): remove it "
                              f"and retry, or align llama-cpp-python's version with the server's")
        self.model_ptr = model
        self._finalizer = weakref.finalize(self, L.llama_model_free, model)
        self.vocab_ptr = L.llama_model_get_vocab(model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab_ptr))

    def metadata(self, key: str) -> str | None:
        from ..llamacpp._lib import meta_str

        return meta_str(self.model_ptr, key)

    @property
    def chat_template(self) -> str | None:
        return self.metadata("tokenizer.chat_template")


def load_gguf_tokenizer(path: Path) -> Any:
    """The :class:`LlamaTokenizer` of the vocab-only GGUF at ``path``."""
    try:
        from ..llamacpp.vocab import LlamaTokenizer
    except ImportError as exc:  # pragma: no cover - llama-cpp-python absent
        raise RemoteError(f"the server serves a GGUF: models.remote tokenizes with llama.cpp's own code, which needs "
                          f"llama-cpp-python here too (pip install 'continuum[llamacpp]') [{exc}]") from exc
    return LlamaTokenizer(VocabOnlyModel(path))  # type: ignore[arg-type]
