"""One GGUF model and its one ``llama_context``: loading, the context's settings, and the lock every call takes.

The context is shared by every state of the model: a state's KV is a *sequence* of its unified KV cache
(``sequences.py``). So the settings are fixed here, once, for what states need:

* ``kv_unified=True``: every sequence sees the whole pool of ``n_ctx`` cells, and ``seq_cp`` shares cells
  (a fork is metadata only). Without it a fork copies whole buffers.
* ``n_seq_max`` sequence ids (at most 256, llama.cpp's ``LLAMA_MAX_SEQ``); ids stay below it (a state blob
  with a larger id is refused on load).
* ``n_batch >= n_seq_max`` (every decode reserves ``n_seq_max`` output rows; fewer aborts the process) and a
  fixed ``n_ubatch`` (the physical split changes the kernels, hence the logits).
* ``swa_full=True``: a sliding-window model keeps every cell, so forks and slices behind the window stay valid.
* explicit ``flash_attn`` and KV types: both are part of a saved blob's layout (``fingerprint.py``).
* ``batch_invariant=True`` makes a row's logits independent of what else is decoded and cached with it:
  the weights are loaded without CPU repacking (``use_extra_bufts=False``: repacked kernels group rows by 4),
  attention is flash attention (without it a row's logits depend on where its cells lie in the cache: 0.26 on
  stories260K q8_0 when a neighbour's cells shift them), and a decode of one token is padded to two with a
  scratch sequence (``decode.py``: llama.cpp's matmuls take another kernel for a single row), and K-quant weights
  are multiplied by one kernel whatever a micro-batch's row count (``GGML_CPU_TILED_MM=0``, set by the first
  invariant model before llama.cpp computes anything: ``_lib.pin_kernels``; the tiled kernel it turns off takes
  micro-batches of 8+ rows and rounds differently, up to ~1.1 on Gemma 3 Q4_K_M). The variable is process-wide and
  read once: a process that decoded before its first invariant model was made keeps the tiled kernel, and the model
  warns. Measured exact on stories260K f32 and q8_0 and on Gemma 3 Q4_K_M: rows alone, merged, reordered, prefills
  in chunks, reused views vs fresh ones. Not made equal: a token decoded alone vs the same position inside a
  prefill past ~16 tokens (0.003-0.04 on f32), several prompts prefilled in one decode past ~64 rows (flash
  attention's tiled path: the invariant mode gives a prefill its own decode), and where a sequence's cells land among
  other live sequences' cells (holes, interleaving: 0.27 on q8_0 with six threads; up to ~4 on Gemma 3 Q4_K_M).

llama.cpp's context is not thread-safe and ctypes releases the GIL during calls: every call on a model's
pointers runs under :attr:`LlamaCppModel.lock`.

Example:
    >>> m = LlamaCppModel("stories260K-f32.gguf", n_ctx=2048)   # doctest: +SKIP
    >>> m.n_vocab, m.context_length, m.n_swa                     # doctest: +SKIP
    (512, 512, 0)
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError
from ._lib import TILED_MM, lib, meta_str, pin_kernels
from .amx import decide
from .bufts import apply

__all__ = ["LlamaCppModel", "KV_TYPES", "GGUF_MAGIC"]

GGUF_MAGIC = b"GGUF"
# ggml type ids of the KV cache types offered (quantized V needs flash attention).
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def check_gguf(path: str | os.PathLike) -> Path:
    """``path`` as a Path if it names a readable GGUF file, else a :class:`ModelLoadError` saying what it is."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"no GGUF file at {str(p)!r}: check the path (a .gguf file, e.g. one downloaded from the "
                             "Hugging Face Hub)")
    if p.is_dir():
        ggufs = sorted(q.name for q in p.glob("*.gguf"))
        hint = f"; it holds {', '.join(ggufs[:5])}" if ggufs else ""
        raise ModelLoadError(f"{str(p)!r} is a directory, not a GGUF file: pass the .gguf file itself{hint}")
    try:
        with p.open("rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {str(p)!r}: {exc}") from exc
    if head != GGUF_MAGIC:
        raise ModelLoadError(f"{str(p)!r} is not a GGUF file (it starts with {head!r}, not b'GGUF'): llama.cpp loads "
                             "GGUF only; convert a Hugging Face checkpoint with llama.cpp's convert_hf_to_gguf.py, or load it "
                             "with continuum.models.transformers")
    return p


def _free(L: Any, model: Any, ctx: Any) -> None:
    if ctx:
        L.llama_free(ctx)
    if model:
        L.llama_model_free(model)


class LlamaCppModel:
    """A GGUF model on llama.cpp with one context (unified KV cache) shared by all of its sequences.

    Args:
        path: the .gguf file.
        n_ctx: KV cells in the pool every live sequence shares (shared prefixes count once); default the model's
            training context (at least 4096), cut to what a quarter of the available memory holds (``default_n_ctx``;
            the repr says which). A small pool only costs time: calls wait for room (``continuum.loop.scheduler``).
        n_threads: CPU threads (default: the cores this process may use).
        n_seq_max: sequence ids (1..256): the number of states whose KV can be resident at once.
        n_batch: the most tokens one ``llama_decode`` takes (default ``max(n_seq_max, n_ubatch)``); decodes
            are chunked at it.
        n_ubatch: the physical micro-batch, fixed (512).
        flash_attn: flash attention on (default) or off (it sets a saved blob's V layout). On is faster at every
            size on the CPU, and its kernel skips other sequences' cells (``decode.py`` keeps merged steps on that
            path); the batch-invariant mode needs it (without it a row's logits depend on where its cells lie).
        kv_type: the KV cache's type, one of :data:`KV_TYPES` (``"f16"``, llama.cpp's default).
        batch_invariant: load the weights without CPU repacking, so that a row's logits are the same whatever
            else its decode carries.

    Raises:
        ModelLoadError: a missing path, a directory, a file that is not GGUF, a model llama.cpp cannot load or
            run as a decoder, or a setting out of range.
    """

    def __init__(self, path: str | os.PathLike, *, n_ctx: int | None = None, n_threads: int | None = None,
                 n_seq_max: int = 256, n_batch: int | None = None, n_ubatch: int = 512, flash_attn: bool | None = None,
                 kv_type: str = "f16", batch_invariant: bool = False):
        L = lib()
        self.path = check_gguf(path)
        flash_attn = _check_options(n_ctx, n_threads, n_seq_max, n_batch, n_ubatch, flash_attn, kv_type)
        self.lock = threading.RLock()
        self.pool_ref: Any = None  # a weak reference to its one SequencePool (sequences.SequencePool.of)
        self.kv_fingerprint: Any = None  # what its KV blobs are valid for (fingerprint.fingerprint_of, computed once)
        self.flash_attn, self.kv_type, self.batch_invariant = bool(flash_attn), kv_type, bool(batch_invariant)
        self.n_threads = n_threads or _cores()
        self._pin_kernels()
        model = self._load()
        # a hybrid's recurrent part (one summary per sequence) cannot be cut back: recurrent.py keeps snapshots
        self.hybrid = bool(L.llama_model_is_hybrid(model))
        self.n_ctx_train = int(L.llama_model_n_ctx_train(model))
        self.n_swa = int(L.llama_model_n_swa(model))
        self.n_ctx_reason = "asked"
        if n_ctx is None:
            n_ctx, self.n_ctx_reason = default_n_ctx(self.n_ctx_train, self.kv_bytes_per_cell(kv_type), n_seq_max)
        if n_ctx < n_seq_max:  # (llama.cpp aborts the process: its batch, clamped to n_ctx, must hold n_seq_max outputs)
            self.close()
            raise ModelLoadError(f"n_ctx={n_ctx} cells is below n_seq_max={n_seq_max}: llama.cpp needs room for a batch "
                                 "of n_seq_max tokens; raise n_ctx or lower n_seq_max")
        ctx = self._context(model, n_ctx, n_batch or max(n_seq_max, n_ubatch), n_ubatch, n_seq_max)
        self.n_ctx = int(L.llama_n_ctx(ctx))
        # llama.cpp clamps n_batch to n_ctx: read back what it runs (a decode over n_batch aborts the process)
        self.n_batch, self.n_ubatch, self.n_seq_max = int(L.llama_n_batch(ctx)), int(L.llama_n_ubatch(ctx)), n_seq_max
        if self.n_batch < n_seq_max:
            self.close()
            raise ModelLoadError(f"n_ctx={self.n_ctx} cells is below n_seq_max={n_seq_max}: llama.cpp needs a batch of "
                                 "n_seq_max tokens; raise n_ctx or lower n_seq_max")
        self.vocab_ptr = L.llama_model_get_vocab(model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab_ptr))
        self.memory = L.llama_get_memory(ctx)

    def _pin_kernels(self) -> None:
        """The batch-invariant mode turns the tiled K-quant matmul off (before anything computes: ggml reads the
        variable once, at the process's first matmul); a warning where it cannot."""
        self.pinned_kernels = pin_kernels() if self.batch_invariant else os.environ.get(TILED_MM) == "0"
        if self.batch_invariant and not self.pinned_kernels:
            why = (f"{TILED_MM}={os.environ[TILED_MM]} is set" if TILED_MM in os.environ else
                   f"this process already decoded with it on (ggml reads {TILED_MM} once)")
            warnings.warn(f"{self.path.name}: the batch-invariant mode cannot turn llama.cpp's tiled K-quant matmul off: "
                          f"{why}. Rows of K-quant weights decoded beside 8+ others may differ from each alone. Make the "
                          f"invariant model first, or start the process with {TILED_MM}=0 (f32, f16 and q8_0 files are "
                          "unaffected)", RuntimeWarning, stacklevel=4)

    def _load(self) -> Any:
        """The ``llama_model`` (CPU), refused clearly where continuum cannot run it."""
        L = lib()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        # where llama.cpp's AMX matmul could crash the process (llama.cpp #20824), load around it: ``amx.py`` probes it
        # once per build and CPU in a child. The batch-invariant mode loads no extra buffer type at all (no AMX either).
        self.load_mode = "plain" if self.batch_invariant else decide(self.path, self.n_threads).mode
        self._overrides = apply(mparams, self.load_mode, self.path)  # (read by the load through a pointer: kept alive)
        with self.lock:
            model = L.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load {str(self.path)!r} (a truncated or corrupt GGUF, or an "
                                 "architecture this llama-cpp-python build does not know); set "
                                 "logging.getLogger('llama-cpp-python').setLevel(logging.DEBUG) to see llama.cpp's log")
        self._model, self._ctx = model, None
        self._finalizer = weakref.finalize(self, _free, L, model, None)
        if L.llama_model_has_encoder(model) or L.llama_model_is_recurrent(model) or L.llama_model_is_diffusion(model):
            self.close()
            raise ModelLoadError(f"{self.path.name}: continuum runs decoder-only GGUFs on llama.cpp, attention or hybrid "
                                 "(attention + recurrent layers, e.g. LFM2); encoder-decoder, pure recurrent (Mamba, "
                                 "RWKV) and diffusion models are not supported (docs/hybrid.md)")
        return model

    def _context(self, model: Any, n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int) -> Any:
        """The one ``llama_context`` (unified KV of ``n_ctx`` cells, every cell kept: ``swa_full``)."""
        L = lib()
        cparams = L.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = n_ctx, n_batch, min(n_ubatch, n_batch), n_seq_max
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.type_k = cparams.type_v = KV_TYPES[self.kv_type]
        cparams.kv_unified, cparams.swa_full, cparams.embeddings, cparams.no_perf = True, True, False, True
        with self.lock:
            ctx = L.llama_init_from_model(model, cparams)
        if not ctx:
            head = self._head_dims()
            self.close()
            if self.kv_type == "q8_0" and head and any(d % 32 for d in head):  # (llama.cpp's q8_0 blocks hold 32 values)
                raise ModelLoadError(f"kv_type='q8_0' needs attention heads of a multiple of 32 values; "
                                     f"{self.path.name} has {head[0]}: use kv_type='f16' (the default) or 'f32'")
            raise ModelLoadError(f"llama.cpp could not create a context for {self.path.name} (n_ctx={n_ctx}, "
                                 f"n_batch={n_batch}, n_seq_max={n_seq_max}, kv_type={self.kv_type!r}): lower n_ctx if "
                                 "memory is short")
        self._finalizer.detach()
        self._ctx = ctx
        self._finalizer = weakref.finalize(self, _free, L, model, ctx)
        return ctx

    # -- pointers ---------------------------------------------------------------------------
    @property
    def ctx(self) -> Any:
        """The ``llama_context`` pointer (call it under :attr:`lock`)."""
        if not self._ctx:
            raise ModelLoadError(f"the llama.cpp model {self.path.name} was closed")
        return self._ctx

    @property
    def model_ptr(self) -> Any:
        if not self._model:
            raise ModelLoadError(f"the llama.cpp model {self.path.name} was closed")
        return self._model

    def close(self) -> None:
        """Free the context and the weights now (otherwise when the object is collected)."""
        with self.lock:
            self._finalizer()
            self._model = self._ctx = None

    # -- what the model is --------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        """The most tokens one sequence may hold: the model's trained context, bounded by the cell pool."""
        return min(self.n_ctx_train, self.n_ctx)

    @property
    def is_sliding(self) -> bool:
        """True for a sliding-window model (Gemma 2/3...): reuse behind the window needs the window's cells."""
        return self.n_swa > 0

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text (``"general.architecture"``, ``"tokenizer.chat_template"``...), or None."""
        with self.lock:
            return meta_str(self.model_ptr, key)

    def _num(self, key: str) -> int | None:
        value = self.metadata(f"{self.architecture}.{key}")
        return int(value) if value is not None and value.isdigit() else None

    def _head_dims(self) -> tuple[int, int] | None:
        """``(key, value)`` values per attention head, from the GGUF's metadata; None when it does not say."""
        width, heads = self._num("embedding_length"), self._num("attention.head_count")
        head = width // heads if width and heads else None
        k_len, v_len = self._num("attention.key_length") or head, self._num("attention.value_length") or head
        return (k_len, v_len) if k_len and v_len else None

    def kv_bytes_per_cell(self, kv_type: str | None = None) -> int | None:
        """Bytes one KV cell takes over every layer (keys and values), from the GGUF's attention shape; None when
        the file does not say."""
        layers, heads_kv, heads = self._num("block_count"), self._num("attention.head_count_kv"), \
            self._num("attention.head_count")
        dims = self._head_dims()
        if not (layers and dims):
            return None
        k_len, v_len = dims
        per = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}[kv_type or self.kv_type]
        return int(layers * (heads_kv or heads or 1) * (k_len + v_len) * per)

    @property
    def chat_template(self) -> str | None:
        """The GGUF's own chat template (``tokenizer.chat_template``), or None."""
        return self.metadata("tokenizer.chat_template")

    @property
    def architecture(self) -> str:
        return self.metadata("general.architecture") or "unknown"

    def __repr__(self) -> str:
        mode = (", batch_invariant" + ("" if self.pinned_kernels else " (tiled K-quant matmul on: see the warning)")
                if self.batch_invariant else "")
        return (f"LlamaCppModel({self.path.name!r}, n_ctx={self.n_ctx} ({self.n_ctx_reason}), n_seq_max={self.n_seq_max}, "
                f"n_threads={self.n_threads}{mode})")


def _available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_n_ctx(n_ctx_train: int, per_cell: int | None, n_seq_max: int) -> tuple[int, str]:
    """The pool's cells when ``n_ctx`` is not given, and why: the model's training context (at least 4096), as
    llama-server sizes its context, cut to what a quarter of the available memory holds; a multiple of 256, at least
    ``n_seq_max``. A small pool only costs time (calls wait for room: ``continuum.loop.scheduler``)."""
    n, reason = max(4096, n_ctx_train), "the model's training context" if n_ctx_train >= 4096 else "at least 4096"
    free = _available_memory()
    if per_cell and free:
        fits = free // 4 // per_cell
        if fits < n:
            n, reason = fits, "a quarter of the memory available"
    return max(n_seq_max, n // 256 * 256, 256), reason


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ModelLoadError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")


def _check_options(n_ctx: int | None, n_threads: int | None, n_seq_max: int, n_batch: int | None, n_ubatch: int,
                   flash_attn: bool | None, kv_type: str) -> bool:
    """The options checked before anything loads (a ModelLoadError naming the bad one); the flash-attention flag."""
    _check_int("n_seq_max", n_seq_max, 1, int(lib().llama_max_parallel_sequences()))
    _check_int("n_ubatch", n_ubatch, 1, 1 << 20)
    if n_ctx is not None:
        _check_int("n_ctx", n_ctx, 1, 1 << 24)
    if n_threads is not None:
        _check_int("n_threads", n_threads, 1, 1024)
    if n_batch is not None:
        _check_int("n_batch", n_batch, max(n_seq_max, 1), 1 << 20)
    if kv_type not in KV_TYPES:
        raise ModelLoadError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
    flash_attn = True if flash_attn is None else flash_attn
    if kv_type not in ("f16", "f32", "bf16") and not flash_attn:
        raise ModelLoadError(f"a quantized KV cache (kv_type={kv_type!r}) needs flash_attn=True in llama.cpp")
    return flash_attn
