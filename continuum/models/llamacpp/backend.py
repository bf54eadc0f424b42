"""The llama.cpp backend behind the backend protocol (:mod:`continuum.models.protocol`): ``models.llamacpp(path)``.

A state's KV is a :class:`~.seqkv.SeqKV`: one :class:`~.sequences.KVView` per row (a view of a llama.cpp sequence: forks and
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

from ...errors import KVCacheFullError, ModelLoadError, SequencesExhaustedError
from ..capacity import Capacity
from ..request import Request
from . import capacity, cells, recurrent, window
from .decode import DecodeRow, decode
from .fingerprint import fingerprint_of
from .gather import RowPlan, fill_results, plan_rows
from .model import LlamaCppModel
from .seqkv import SeqKV
from .sequences import SequencePool
from .tree import TreeKV, run_trees
from .vocab import LlamaTokenizer

if TYPE_CHECKING:
    from ...loop.engine import Engine

__all__ = ["LlamaCpp", "SeqKV", "llamacpp"]  # (SeqKV lives in seqkv.py)


class LlamaCpp:
    """A GGUF model on llama.cpp, with the interface the loop, the engine and the states use.

    Args:
        path: a ``.gguf`` file, or a :class:`~.model.LlamaCppModel` already loaded (then ``options`` are its own:
            pass none; ``continuum serve`` loads the GGUF on a thread while torch imports).
        prefix_cache: byte budget of the prefix cache (donor sequences, :mod:`~.prefix`; ``"64MiB"``, an int);
            ``None``/``0`` (default): off.
        idle_cells: cells that states nobody is decoding (held between calls) keep resident at least, beside the
            running ones' (default 256); past it the least recently used are spilled to host memory, because every
            decode's attention runs over every cell in use (:func:`~.cells.trim_idle`). ``None``: keep all.
        n_ctx, n_threads, batch_invariant, ...: see :class:`~.model.LlamaCppModel`.
    """

    kv_budget: int | None = None  # (the pool's own size bounds it: n_ctx cells, planned by continuum.loop.scheduler)

    @property
    def max_call_rows(self) -> int:
        """The most rows one call decodes at once: the pool's sequence ids (a list call with more runs in turns)."""
        return self.pool.n_ids

    def __init__(self, path: str | os.PathLike | LlamaCppModel, *, prefix_cache: int | str | None = None,
                 idle_cells: int | None = cells.IDLE_CELLS, **options: Any):
        from ..budget import parse_budget  # (the same budget syntax on both backends)

        budget = parse_budget(prefix_cache)  # a bad budget fails before the GGUF is loaded
        if idle_cells is not None and (isinstance(idle_cells, bool) or not isinstance(idle_cells, int) or idle_cells < 0):
            raise ModelLoadError(f"idle_cells must be a number of cells >= 0, or None (keep every idle state resident); "
                                 f"got {idle_cells!r}")
        if isinstance(path, LlamaCppModel):
            if options:
                raise ModelLoadError(f"LlamaCpp(a loaded LlamaCppModel, ...): its options are set already; drop "
                                     f"{', '.join(sorted(options))}")
            self.llama = path
        else:
            self.llama = LlamaCppModel(path, **options)
        self.hybrid = self.llama.hybrid  # attention + recurrent layers: recurrent.py keeps the summaries' snapshots
        if self.hybrid and budget:
            self.llama.close()
            raise ModelLoadError(f"{self.llama.path.name} has recurrent layers: drop prefix_cache= (a donor's prefix "
                                 "of any length would need a recurrent snapshot there; a state keeps its own: "
                                 "docs/hybrid.md)")
        self.tokenizer = LlamaTokenizer(self.llama)
        self.pool = SequencePool.of(self.llama)
        self.pool.kv_bytes_per_token = self.kv_bytes_per_token  # type: ignore[attr-defined]  # (read by SeqKV.nbytes)
        self.pool.idle_cells = idle_cells
        self.context_length: int | None = self.llama.context_length
        self.prefix_cache: Any = None
        if budget:
            from .prefix import DonorCache

            self.prefix_cache = DonorCache(self, budget)
        self.tokens_computed = 0
        self.forward_calls = 0
        self.count_lock = threading.Lock()  # for the counters above and the engine (tree.run_trees counts too)
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

    world_size = 1  # (one process: llama.cpp's own threads are inside it)
    # The engine's default max_rows (vLLM's max_num_seqs): in one unified pool every token's attention walks every live
    # sequence's cells, so past a few dozen rows a step costs more than the rows it adds. Measured on Gemma 3 270M,
    # 2 cores, 128 programs x 48 tokens: 96.6 / 83.8 tok/s at 32 rows a step vs 86.7 / 77.9 at 256 (B26a).
    # model.engine.max_rows = N sets another bound.
    default_max_rows = 32

    def same_model(self, other: Any) -> bool:
        return other is self or (isinstance(other, LlamaCpp) and other.fingerprint == self.fingerprint)

    def holds(self, kv: SeqKV) -> bool:
        """Whether ``kv``'s cells are in this instance's pool (another instance of the same file has its own)."""
        return all(v.pool is self.pool for v in kv.views)

    def save_kv(self, kv: SeqKV) -> tuple[dict[str, torch.Tensor], dict]:
        """A state's KV for its file: each distinct sequence's bytes once, behind this model's fingerprint."""
        from .persist import save_kv

        return save_kv(self, kv)

    def load_kv(self, tensors: dict[str, torch.Tensor], meta: dict) -> SeqKV:
        """The KV :meth:`save_kv` stored, in fresh sequences (``ForeignStateError`` etc. when it is not valid here)."""
        from .persist import load_kv

        return load_kv(self, tensors, meta)

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

            with self.count_lock:
                engine = self.__dict__.get("_engine") or Engine(self)
                self.__dict__["_engine"] = engine
        return engine

    # -- the forward -------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: Any, *,
                logits: str = "last", reserve: int = 0, allowed: torch.Tensor | None = None,
                outputs: torch.Tensor | None = None) -> tuple[torch.Tensor | None, Any]:
        """See :meth:`continuum.models.protocol.Backend.forward`; merged with other calls' by the engine."""
        engine = self.__dict__.get("_engine")
        if engine is not None:
            return engine.forward(input_ids, attention_mask, position_ids, cache, logits, reserve, allowed, outputs)
        return self.forward_now(input_ids, attention_mask, position_ids, cache, logits=logits, reserve=reserve,
                                   allowed=allowed, outputs=outputs)

    def forward_now(self, input_ids, attention_mask, position_ids, cache, *, logits="last", reserve=0, allowed=None,
                    outputs=None):
        req = Request(input_ids, attention_mask, position_ids, cache, logits=logits, reserve=reserve, allowed=allowed,
                      outputs=outputs)
        if allowed is None:
            self._run([req])
        else:
            run_trees(self, [req])
        if req.error is not None:
            raise req.error
        return req.result

    def run_step(self, requests: list[Request], stats: dict) -> None:
        """Every request of the step in ONE ``llama_decode``; token trees (choice scoring) in one more (``tree.py``).

        In the batch-invariant mode only one-token steps are merged: a request that prefills several tokens gets a
        ``llama_decode`` of its own, exactly the one it gets alone (merged prefills of quantized weights differ from
        each alone, 0.84 on Gemma 3 Q4_K_M, while merged one-token steps are exact: B24h)."""
        ok = [r for r in requests if r.allowed is None]
        trees = [r for r in requests if r.allowed is not None]
        t = time.perf_counter()
        if self.llama.batch_invariant and any(r.new > 1 for r in ok):
            steps = [r for r in ok if r.new <= 1]
            for group in ([steps] if steps else []) + [[r] for r in ok if r.new > 1]:
                self._run(group, stats)
                self._hold_results(group)
        elif ok or not trees:
            self._run(ok, stats)
            self._hold_results(ok)
        for group in ([[t] for t in trees] if self.llama.batch_invariant else [trees] if trees else []):
            run_trees(self, group)  # (a tree is a multi-token decode: in the invariant mode each runs alone, as above)
            self._hold_results(group)
        stats["forward_s"] += time.perf_counter() - t
        stats["merged_forwards"] += 1
        stats["requests_merged"] += len(requests)
        stats["peak_rows"] = max(stats.get("peak_rows", 0), sum(r.rows for r in requests))  # (token trees: their rows)

    def _hold_results(self, requests: list[Request]) -> None:
        """The sequences ``requests`` decoded into (new forks among them) stay held for the rest of the step: the
        engine held only their inputs' (:meth:`hold`), so a token tree decoded after them made room by spilling a
        running call's new rows, whose restore, without the fork's sharing, then no longer fit (the oracle: "no room
        to restore a spilled state of 57 tokens" for 6 forks of a 2-row state on 256 cells)."""
        for r in requests:
            kv = r.result[1] if r.error is None and isinstance(r.result, tuple) else None
            views = kv.views if isinstance(kv, SeqKV) else [v for vs in kv.leaves for v in vs] \
                if isinstance(kv, TreeKV) else []
            self.pool.held.update(id(v.seq) for v in views if v.seq is not None)

    def stale_rows(self, kv: SeqKV | None) -> list[int]:
        """Rows of ``kv`` a decode could not extend (a sliding window's cells gone: :mod:`.window`; a hybrid's
        recurrent summary not kept: :func:`.recurrent.stale`, which keeps it at each view's end first); the loop
        recomputes them from their tokens."""
        if kv is None:
            return []
        return recurrent.stale(self.pool, kv.views) if self.hybrid else window.stale(self.pool, kv.views)

    def capacity(self, requests: list[Request]) -> Capacity:
        """The pool's cells and ids now, ``requests``' KV held (the capacity model: ``continuum.models.capacity``)."""
        return capacity.capacity(self.pool, requests)

    def step_need(self, request: Request) -> int:
        """Cells ``request`` adds in its step (new tokens, tree nodes, spilled states restored)."""
        return capacity.step_need(request)

    def row_cells(self, kv: SeqKV) -> int:
        """The most cells one row of a state on ``kv`` takes resident (a spilled one: its restore); splitting a call
        into parts prices a row at least at this (``loop/turns.py``)."""
        with self.pool.model.lock:
            return capacity.row_cells(kv)

    def rows_cells(self, kv: SeqKV, rows: list[int]) -> int:
        """Cells ``rows`` of ``kv`` (a prompt's samples) take together resident, a fork family's shared cells once;
        a call's samples are split into groups only where this and their new tokens outgrow the pool."""
        with self.pool.model.lock:
            return capacity.rows_cells(kv, rows)

    def costly_rows(self, kv: SeqKV, spilled: bool = False) -> list[int]:
        """Rows of ``kv`` cheaper to compute from their tokens than to restore (``loop/setup.recompute_costly``);
        ``spilled``: every row whose sequence is spilled."""
        with self.pool.model.lock:
            return capacity.costly_rows(kv, spilled)

    def hold(self, requests: list[Request]) -> None:
        """Keep the sequences of ``requests`` (their KV, and their new KV once run) resident through the next step:
        under pressure the pool spills everything else first (user-held states, parked calls; the protocol)."""
        seqs: set[int] = set()
        for r in requests:
            for kv in (r.kv, r.result[1] if isinstance(r.result, tuple) else None):
                if isinstance(kv, SeqKV):
                    seqs.update(id(v.seq) for v in kv.views if v.seq is not None)
        self.pool.held = seqs

    def _run(self, requests: list[Request], stats: dict | None = None) -> None:
        """Decode ``requests`` together; each gets its result or its own error (the backend protocol's promise).

        A request whose planning fails gets that error and stays out of the decode. A failed decode is re-run
        without the requests it can blame (an error naming rows, ``.rows``: :class:`StaleWindowError`), or each
        request alone (any other error), so a row's error never fails its neighbours. Ctrl-C (an exception that
        is not an ``Exception``) propagates."""
        requests = [r for r in requests if r.column is not None or _views_match(r)]  # (a decode step: its own views)
        self._decode(requests, stats)

    def _decode(self, requests: list[Request], stats: dict | None) -> None:
        """Plan each request (its own error if it cannot be), decode the planned ones together, fill results."""
        rows: list[DecodeRow] = []
        planned, plans = [], []
        for r in requests:
            first = len(rows)
            try:
                plans.append(plan_rows(r, self.pool, rows))
            except Exception as exc:  # noqa: BLE001  (a request that cannot be planned fails alone)
                del rows[first:]
                r.error = exc
                continue
            planned.append(r)
        if requests and not planned:
            return
        try:
            out = decode(self.pool, rows)  # (failures leave every view as it was: re-running is safe)
        except (KVCacheFullError, SequencesExhaustedError) as exc:  # no room: every request waits (the engine parks)
            for r in planned:
                r.error = exc
            return
        except Exception as exc:  # noqa: BLE001  (handed to its owners below, or re-run to find them)
            self._fall_back(planned, plans, exc, stats)
            return
        computed = sum(len(row.tokens) for row in rows)
        with self.count_lock:
            self.tokens_computed += computed
            self.forward_calls += 1
        fill_results(planned, plans, out, SeqKV, self.vocab_size)

    def _fall_back(self, requests: list[Request], plans: list[RowPlan], exc: Exception, stats: dict | None) -> None:
        """After a failed decode of ``requests``: ``exc`` to the requests owning the rows it names and the others
        decoded again without them; an error naming no row: each request alone, so only its owner gets it."""
        if len(requests) == 1:
            requests[0].error = exc
            return
        if stats is not None:
            stats["fallbacks"] = stats.get("fallbacks", 0) + 1
        named = [k for k in getattr(exc, "rows", None) or [] if isinstance(k, int)]  # rows of this decode
        blamed = {i for i, (r, p) in enumerate(zip(requests, plans)) if any(p.first <= k < p.first + r.rows for k in named)}
        if not blamed:
            for r in requests:
                self._decode([r], stats)
            return
        for i in blamed:  # (alone, the error names the request's own rows)
            self._decode([requests[i]], stats)
        self._decode([r for i, r in enumerate(requests) if i not in blamed], stats)


def _views_match(r: Request) -> bool:
    """Cut ``r``'s views to its mask's cached columns (a state whose mask cut cached tokens: no view may reach
    them); False, with ``r.error`` set, where they cannot be (that request alone fails)."""
    try:
        r.materialize()
        if r.kv is not None:
            r.kv = r.kv.matching(r.mask[:, :r.mask.shape[1] - r.ids.shape[1]])
    except Exception as exc:  # noqa: BLE001  (a malformed request fails alone)
        r.error = exc
        return False
    return True


def llamacpp(path: str | os.PathLike | LlamaCppModel, **options: Any) -> LlamaCpp:
    """A GGUF model on llama.cpp (``pip install continuum[llamacpp]``). Options: see :class:`~.model.LlamaCppModel`.

    Example:
        >>> model = models.llamacpp("stories260K-f32.gguf")               # doctest: +SKIP
    """
    return LlamaCpp(path, **options)

