"""The llama.cpp backend behind the backend protocol (:mod:`continuum.models.protocol`): ``models.llamacpp(path)``.

A state's KV is a :class:`SeqKV`: one :class:`~.sequences.KVView` per row (a view of a llama.cpp sequence: forks and
slices share cells) and the layout columns it covers (``cols``: which of the state's cached columns are real
tokens, so a crop by columns maps to a view of that many positions). :meth:`LlamaCpp.forward` decodes each row's
real new tokens on its view (:func:`~.decode.decode`: one ``llama_decode`` for all rows) and scatters the logits
back to the columns the loop asked for; :meth:`LlamaCpp.run_step` runs every request of an engine step in that
same single decode.

Example:
    >>> from continuum import continuous, generate, models, samplers
    >>> model = models.llamacpp("stories260K-f32.gguf", batch_invariant=True)         # doctest: +SKIP
    >>> continuous(generate.text(model, samplers.greedy()))("Once upon a time", max_tokens=20)   # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
import time
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from ...errors import ContinuumError
from ..request import Request
from .decode import DecodeRow, decode
from .fingerprint import fingerprint_of
from .gather import fill_results, plan_rows
from .model import LlamaCppModel
from .sequences import KVView, SequencePool
from .vocab import LlamaTokenizer

if TYPE_CHECKING:
    from ...loop.engine import Engine

__all__ = ["LlamaCpp", "SeqKV", "llamacpp"]


class SeqKV:
    """The KV of a batch of rows on llama.cpp: a view per row and the cached columns of the rows' layout.

    ``cols`` is a bool ``(rows, columns)`` tensor: column ``j`` of row ``r`` holds a real (cached) token. Row ``r``'s
    view covers ``cols[r].sum()`` positions. Every method returns a new ``SeqKV``; views are immutable.
    """

    __slots__ = ("views", "cols")

    def __init__(self, views: list[KVView], cols: torch.Tensor):
        self.views, self.cols = views, cols

    def __repr__(self) -> str:
        return f"SeqKV(rows={len(self.views)}, columns={self.cols.shape[1]}, {self.views!r})"

    def length(self) -> int:
        return int(self.cols.shape[1])

    def select_rows(self, rows: torch.Tensor) -> SeqKV:
        idx = rows.tolist()
        return SeqKV([self.views[i] for i in idx], self.cols[rows.to(self.cols.device)])

    def crop(self, columns: int) -> SeqKV | None:
        if columns <= 0:
            return None
        if columns >= self.length():
            return self
        cols = self.cols[:, :columns]
        keep = cols.sum(1).tolist()
        return SeqKV([v if n == v.n_tokens else v.slice(int(n)) for v, n in zip(self.views, keep)], cols)

    def narrow(self, rows: int, lead: int) -> SeqKV:
        return SeqKV(self.views[:rows], self.cols[:rows, lead:])

    def settle(self) -> SeqKV:
        return self

    def nbytes(self, seen: set | None = None) -> int:
        """Bytes of the cells the views reach, each sequence counted once (its longest view): an upper bound, since
        cells a fork shares with its parent sequence (``seq_cp``) are counted in both."""
        seen = set() if seen is None else seen
        per_token = getattr(self.views[0].pool, "kv_bytes_per_token", 0) if self.views else 0
        longest: dict[int, int] = {}
        for v in self.views:
            s = getattr(v, "_seq", None)
            if s is not None and id(s) not in seen:
                longest[id(s)] = max(longest.get(id(s), 0), v.n_tokens)
        seen.update(longest)
        return per_token * sum(longest.values())

    @classmethod
    def stack(cls, kvs: list, width: int, reserve: int = 0) -> SeqKV:
        views: list[KVView] = []
        parts = []
        for kv in kvs:
            if kv is None:
                raise ContinuumError("cannot stack a llama.cpp KV with rows that have none")
            pad = width - kv.length()
            parts.append(torch.nn.functional.pad(kv.cols, (pad, 0)))
            views.extend(kv.views)
        return SeqKV(views, torch.cat(parts))


class LlamaCpp:
    """A GGUF model on llama.cpp, with the interface the loop, the engine and the states use.

    Args:
        path: a ``.gguf`` file.
        n_ctx, n_threads, batch_invariant, ...: see :class:`~.model.LlamaCppModel`.
    """

    def __init__(self, path: str | os.PathLike, **options: Any):
        self.llama = LlamaCppModel(path, **options)
        self.tokenizer = LlamaTokenizer(self.llama)
        self.pool = SequencePool.of(self.llama)
        self.pool.kv_bytes_per_token = self.kv_bytes_per_token  # type: ignore[attr-defined]  # (read by SeqKV.nbytes)
        self.context_length: int | None = self.llama.context_length
        self.prefix_cache = None
        self.tokens_computed = 0
        self.forward_calls = 0
        self._count_lock = threading.Lock()
        self.layer_devices: tuple[torch.device, ...] = ()
        self.kv_dtype = None

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one position of one sequence takes: every layer's keys and values, from the GGUF's metadata and
        the context's KV type (0 when the metadata does not say)."""
        meta, arch = self.llama.metadata, self.llama.architecture
        try:
            layers = int(meta(f"{arch}.block_count") or 0)
            kv_heads = int(meta(f"{arch}.attention.head_count_kv") or meta(f"{arch}.attention.head_count") or 0)
            heads = int(meta(f"{arch}.attention.head_count") or 1)
            width = int(meta(f"{arch}.embedding_length") or 0) // heads
            k = int(meta(f"{arch}.attention.key_length") or width)
            v = int(meta(f"{arch}.attention.value_length") or width)
        except ValueError:
            return 0
        itemsize = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}.get(self.llama.kv_type, 2.0)
        return int(layers * kv_heads * (k + v) * itemsize)

    def __repr__(self) -> str:
        return f"LlamaCpp({os.path.basename(str(self.llama.path))}, {self.tokenizer!r})"

    @cached_property
    def fingerprint(self) -> Any:
        return fingerprint_of(self.llama)

    def same_model(self, other: Any) -> bool:
        return other is self or (isinstance(other, LlamaCpp) and other.fingerprint == self.fingerprint)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return self.llama.n_vocab

    @property
    def engine(self) -> Engine:
        engine = self.__dict__.get("_engine")
        if engine is None:
            from ...loop.engine import Engine

            with self._count_lock:
                engine = self.__dict__.get("_engine") or Engine(self)
                self.__dict__["_engine"] = engine
        return engine

    # -- the forward -------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: Any, *,
                logits: str = "last", reserve: int = 0, allowed: torch.Tensor | None = None) -> tuple[torch.Tensor | None, Any]:
        """See :meth:`continuum.models.protocol.Backend.forward`; merged with other calls' by the engine."""
        engine = self.__dict__.get("_engine")
        if engine is not None:
            return engine.forward(input_ids, attention_mask, position_ids, cache, logits, reserve, allowed)
        return self._forward_alone(input_ids, attention_mask, position_ids, cache, logits=logits, reserve=reserve,
                                   allowed=allowed)

    def _forward_alone(self, input_ids, attention_mask, position_ids, cache, *, logits="last", reserve=0, allowed=None):
        req = Request(input_ids, attention_mask, position_ids, cache, logits=logits, reserve=reserve, allowed=allowed)
        self._run([req])
        if req.error is not None:
            raise req.error
        return req.result

    def run_step(self, requests: list[Request], stats: dict) -> None:
        """Every request of the step in ONE ``llama_decode`` (a request with a token tree alone: refused)."""
        ok = []
        for r in requests:
            if r.allowed is not None:
                r.error = ContinuumError("choice scoring by token tree is not available on llama.cpp yet: use "
                                         "generate.choice(..., method='greedy')")
            else:
                ok.append(r)
        t = time.perf_counter()
        self._run(ok)
        stats["forward_s"] += time.perf_counter() - t
        stats["merged_forwards"] += 1
        stats["requests_merged"] += len(ok)

    def _run(self, requests: list[Request]) -> None:
        rows: list[DecodeRow] = []
        try:
            plans = [plan_rows(r, self.pool, rows) for r in requests]
            out = decode(self.pool, rows)
        except BaseException as exc:  # noqa: BLE001  (every request of the failed decode gets the error)
            for r in requests:
                r.error = exc
            return
        computed = sum(len(row.tokens) for row in rows)
        with self._count_lock:
            self.tokens_computed += computed
            self.forward_calls += 1
        fill_results(requests, plans, out, SeqKV, self.vocab_size)


def llamacpp(path: str | os.PathLike, **options: Any) -> LlamaCpp:
    """A GGUF model on llama.cpp (``pip install continuum[llamacpp]``). Options: see :class:`~.model.LlamaCppModel`.

    Example:
        >>> model = models.llamacpp("stories260K-f32.gguf")               # doctest: +SKIP
    """
    return LlamaCpp(path, **options)

