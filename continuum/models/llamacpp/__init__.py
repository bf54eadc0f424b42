"""GGUF models on llama.cpp (llama-cpp-python's low-level C API): the backend's own pieces.

Modules, one job each:

* ``_lib.py``: imports the bindings on first use (a clear error without the ``llamacpp`` extra).
* ``model.py``: :class:`LlamaCppModel`, a GGUF and its ONE ``llama_context`` (unified KV cache, 256 sequence ids,
  ``swa_full``, explicit flash attention and KV types, a batch-invariant mode) and the lock every call takes.
* ``vocab.py``: :class:`LlamaTokenizer`, the GGUF's tokenizer over ``llama_vocab`` with the interface of
  :class:`continuum.models.tokenizer.Tokenizer` (encode, decode, token bytes, end-of-generation ids, the
  outlines-core ``Vocabulary``, the llguidance tokenizer).
* ``sequences.py``: :class:`SequencePool` and :class:`KVView`, a state's KV as an immutable view on a refcounted
  llama.cpp sequence (forks and slices share cells, release frees, spilling to bytes when ids run out,
  the sliding-window check); ``seq.py``: :class:`~.seq.Seq`, the record of one sequence its views share.
* ``decode.py``: :func:`decode`, many rows' new tokens in one ``llama_decode`` (:class:`DecodeRow`,
  :class:`DecodeResult`); ``outputs.py``: the arrays its logits are copied into, reused once nothing reads them;
  ``prefill.py``: a prefix the rows of one decode share, decoded once.
* ``gather.py``: the engine's requests as decode rows, and each request's result gathered from the decode (a
  decoding step's rows: one in-place log-softmax, ``samplers.row_max``, no per-row copies).
* ``fingerprint.py``: what a KV blob is valid for (GGUF hash, KV layout, mode, llama.cpp version); ``pack`` and
  ``unpack`` refuse a blob from elsewhere.
* ``persist.py``: a state's KV in its file (each distinct sequence's bytes once), restored into fresh sequences.
* ``prefix.py``: the prefix cache as donor sequences (``prefix_cache=``), reused by ``seq_cp``.
* ``window.py``: sliding-window states kept extendable, and the rows that are not found; ``gaps.py``: the window cells
  llama.cpp gave away behind a sequence's end, found by a probe.

Example:
    >>> from continuum.models.llamacpp import LlamaCppModel, LlamaTokenizer, SequencePool, DecodeRow, decode
    >>> model = LlamaCppModel("stories260K-f32.gguf", batch_invariant=True)     # doctest: +SKIP
    >>> tok, pool = LlamaTokenizer(model), SequencePool.of(model)                 # doctest: +SKIP
    >>> out = decode(pool, [DecodeRow(pool.empty(), tok.encode_prompts(["Once"])[0])])   # doctest: +SKIP
    >>> int(out.row(0)[-1].argmax())                                           # doctest: +SKIP
    ...
"""

from typing import TYPE_CHECKING

# bound now, not lazily: ``decode`` is also this package's submodule, which would take the name when imported
from .decode import DecodeResult, DecodeRow, decode

if TYPE_CHECKING:
    from .fingerprint import LlamaCppFingerprint, fingerprint_of, gguf_hash, pack, unpack
    from .model import KV_TYPES, LlamaCppModel, check_gguf
    from .sequences import KVView, SequencePool
    from .vocab import LlamaTokenizer

__all__ = ["LlamaCppModel", "check_gguf", "KV_TYPES", "LlamaTokenizer", "SequencePool", "KVView", "DecodeRow",
           "DecodeResult", "decode", "LlamaCppFingerprint", "fingerprint_of", "gguf_hash", "pack", "unpack"]

# loaded on first use (PEP 562): continuum.models imports this package, and `continuum serve` loads a GGUF
# through model.py alone while torch imports
_HOME = {"fingerprint": ("LlamaCppFingerprint", "fingerprint_of", "gguf_hash", "pack", "unpack"),
         "model": ("KV_TYPES", "LlamaCppModel", "check_gguf"), "sequences": ("KVView", "SequencePool"),
         "vocab": ("LlamaTokenizer",)}
_LAZY = {name: (f"{__name__}.{module}", name) for module, names in _HOME.items() for name in names}


def __getattr__(name: str):
    from ..._lazy import attribute

    return attribute(globals(), _LAZY, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
