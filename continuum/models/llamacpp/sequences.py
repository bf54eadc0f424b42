"""A state's KV on llama.cpp: an immutable view ``(sequence, n_tokens)`` on a refcounted sequence of the model's
one unified KV cache.

* A view sees the sequence's cells at positions ``0 .. n_tokens-1``; nothing ever changes those cells while the
  view lives. The only cell operations are ``seq_rm(seq, p >= every live view's length, -1)``, ``seq_rm(seq, -1, -1)``
  when no view holds the sequence, and ``seq_cp`` (never ``seq_add``/``seq_div``: they move shared cells).
* A **slice** is a view of the same sequence with fewer tokens (no llama call). A **fork** is
  ``seq_rm(dst, -1, -1)`` + ``seq_cp(src, dst, 0, n)``: the cells are shared (a bit per cell), not copied.
* An **append** (``decode.py``) decodes into the view's own sequence when no live view of it is longer, after
  cutting a dead tail; otherwise it forks first.
* A sequence nobody holds is released (``seq_rm(seq, -1, -1)``, its id back to the pool). Views are dropped by
  the garbage collector or :meth:`KVView.release`; the finalizer only queues the drop, the pool applies it under
  the model's lock at its next call (no llama call ever runs from a finalizer).
* Sequence ids (``n_seq_max``, at most 256) are the scarce resource: when none is free, the least recently used
  sequence that the current operation does not need is **spilled** to host bytes (``llama_state_seq_get_data``)
  and restored into a free id when used again.
* Sliding-window models (``n_swa > 0``): a view can be extended at position ``n`` only if its sequence still holds
  the window's cells, ``seq_pos_min <= max(0, n - n_swa + 1)`` and ``seq_pos_max >= n - 1``. llama.cpp accepts a
  decode without them and returns wrong logits, so :meth:`SequencePool.can_extend` checks it and ``decode``
  raises :class:`~continuum.errors.StaleWindowError` instead (recompute the state's tokens).

Example:
    >>> pool = SequencePool.of(model)                          # doctest: +SKIP
    >>> view = decode(pool, [DecodeRow(pool.empty(), ids)]).views[0]   # doctest: +SKIP
    >>> a, b = pool.fork(view), view.slice(3)              # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

from ...errors import BackendError, KVCacheFullError, SequencesExhaustedError, SlicingError, StaleWindowError
from . import cells, recurrent, reshare, seqbytes, window
from ._lib import lib
from .model import LlamaCppModel
from .seq import Seq

__all__ = ["SequencePool", "KVView"]


class KVView:
    """An immutable handle on the first ``n_tokens`` positions of a llama.cpp sequence (see the module docstring).

    Attributes:
        pool: the :class:`SequencePool` (hence the model) the cells belong to.
        seq: the :class:`~.seq.Seq` it is a view of (None: no cells), shared with the other views of it.
        n_tokens: the number of positions the view sees.
    """

    __slots__ = ("pool", "seq", "n_tokens", "_finalizer", "__weakref__")

    def __init__(self, pool: SequencePool, seq: Seq | None, n_tokens: int):
        self.pool, self.seq, self.n_tokens = pool, seq, n_tokens
        if seq is not None:
            seq.holders[n_tokens] += 1
            self._finalizer: Any = weakref.finalize(self, pool._dropped.append, (seq, n_tokens))
        else:
            self._finalizer = None

    def __repr__(self) -> str:
        where = "empty" if self.seq is None else ("spilled" if self.seq.id is None else f"seq {self.seq.id}")
        return f"KVView({where}, n_tokens={self.n_tokens})"

    def __len__(self) -> int:
        return self.n_tokens

    @property
    def seq_id(self) -> int | None:
        """The llama.cpp sequence id now holding the cells (None: empty, spilled, or released)."""
        return None if self.seq is None else self.seq.id

    @property
    def released(self) -> bool:
        return self._finalizer is not None and not self._finalizer.alive

    def release(self) -> None:
        """Drop this view now (otherwise when it is collected); its sequence is freed once no view holds it."""
        if self._finalizer is not None:
            self._finalizer()

    def slice(self, n: int) -> KVView:
        """The view of the first ``n`` positions (same sequence, no llama call)."""
        return self.pool.slice(self, n)

    def fork(self) -> KVView:
        """A view on a new sequence sharing these cells (``seq_cp``): appends to it never touch this one."""
        return self.pool.fork(self)


class SequencePool:
    """The sequence ids of one model's context, the views on them, and spilling when ids run out."""

    def __init__(self, model: LlamaCppModel):
        owner = model.pool_ref
        if owner is not None and owner() is not None:
            raise BackendError("a llama.cpp model has one SequencePool (its sequence ids and cells): use model's own, "
                               "SequencePool.of(model)")
        model.pool_ref = weakref.ref(self)
        self.model = model
        # the batch-invariant mode keeps the last id for the scratch row that pads a one-token decode (decode.py)
        self.scratch: int | None = model.n_seq_max - 1 if model.batch_invariant else None
        # and (attention models) one that keeps cells nobody needs until room is needed: no hole opens below a live
        # sequence, so its new cells stay in position order (cells.py: keep, flush)
        self.zombie: int | None = model.n_seq_max - 2 if model.batch_invariant and not model.hybrid else None
        self.zombie_cells = 0  # cells only the zombie holds
        last = model.n_seq_max - 1 - (self.scratch is not None) - (self.zombie is not None)
        self.probe: int | None = last if model.n_swa > 0 and not model.hybrid else None  # gaps.intact's (SWA models)
        self.held: set[int] = set()  # (ids of) the sequences the running calls hold: spilled last (LlamaCpp.hold)
        self.idle_cells: int | None = cells.IDLE_CELLS  # idle cells kept resident at least (cells.trim_idle; None: all)
        self.n_ids = model.n_seq_max - (self.scratch is not None) - (self.zombie is not None) - (self.probe is not None)
        if self.n_ids < 1:
            raise BackendError("the batch-invariant mode needs n_seq_max >= 3 (one id pads one-token decodes, one keeps "
                               "released cells)")
        self._free: list[int] = list(range(self.n_ids - 1, -1, -1))  # pop() hands out 0 first
        self.resident: dict[int, Seq] = {}  # the resident sequences by id (others read it; the pool writes it)
        self._dropped: deque[tuple[Seq, int]] = deque()  # filled by view finalizers, applied under the lock
        self._clock = itertools.count(1)
        self.batch_buffers: Any = None  # decode.py's llama_batch arrays (made by its first decode, then reused)
        # counters, for tests and benchmarks; snapshots, restores_recurrent: a hybrid model's recurrent snapshots taken
        # and restored; reshared: restored sequences that share their prefix with a resident relative again (reshare.py)
        self.spills = self.restores = self.repacks = self.snapshots = self.restores_recurrent = self.reshared = 0
        with model.lock:
            lib().llama_memory_clear(model.memory, True)

    @classmethod
    def of(cls, model: LlamaCppModel) -> SequencePool:
        """The model's pool (made on first use)."""
        with model.lock:
            owner = model.pool_ref
            pool = owner() if owner is not None else None
            return pool if pool is not None else cls(model)

    # -- bookkeeping ----------------------------------------------------------------------------
    def collect(self) -> None:
        """Apply the drops the finalizers queued; release sequences nobody holds, and cut the tail no live view
        reaches any more off those still held. Call under the model's lock before reading the pool's sequences."""
        shrunk: dict[int, Seq] = {}
        while self._dropped:
            seq, n = self._dropped.popleft()
            seq.holders[n] -= 1
            if seq.holders[n] <= 0:
                del seq.holders[n]
            if not seq.holders:
                if seq.id is not None:
                    self.release_id(seq.id)
                    seq.id = None
                seq.blob, seq.extent, seq.snaps = None, 0, {}
            elif n > seq.longest:
                shrunk[id(seq)] = seq
        window.trim(self, shrunk.values())

    def release_id(self, seq_id: int) -> None:
        """Sequence ``seq_id`` leaves the pool (released or spilled): its cells dropped (kept, in the invariant mode,
        counted as such), its id free again. Under the model's lock; the caller sets its ``Seq.id`` to None."""
        before = cells.used(self) if self.zombie is not None else 0  # (a walk of every resident sequence: only if used)
        self.resident.pop(seq_id, None)
        self.drop(seq_id)
        if self.zombie is not None:
            self.zombie_cells += before - cells.used(self)
        self._free.append(seq_id)

    def drop(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        """Remove positions ``p0 .. p1-1`` (-1: from the start / to the end) of sequence ``seq_id``. In the
        batch-invariant mode the cells stay, held by the zombie id, until room is needed (``cells.flush``): a freed
        cell below a live sequence's cells would take its next token out of position order (attention sums a
        sequence's cells in cell order), so the one call alone and under load would differ."""
        L = lib()
        if self.zombie is not None:
            L.llama_memory_seq_cp(self.model.memory, seq_id, self.zombie, p0, p1)
        L.llama_memory_seq_rm(self.model.memory, seq_id, p0, p1)

    def _touch(self, seq: Seq) -> None:
        seq.last_use = next(self._clock)

    @property
    def n_free(self) -> int:
        """Sequence ids free now (after releasing what nobody holds)."""
        with self.model.lock:
            self.collect()
            return len(self._free)

    @property
    def n_resident(self) -> int:
        with self.model.lock:
            self.collect()
            return len(self.resident)

    def _acquire(self, pinned: Iterable[Seq] = ()) -> int:
        """A free sequence id, spilling the least recently used sequence outside ``pinned`` if none is free."""
        self.collect()
        if not self._free:
            idle = self.idle(pinned)
            if not idle:
                raise SequencesExhaustedError(
                    f"all {self.n_ids} llama.cpp sequence ids are in use by the rows of this step: run fewer "
                    "rows at once (max_rows), or load the model with a larger n_seq_max (at most 256)")
            self.spill(min(idle, key=lambda s: s.last_use))
        seq_id = self._free.pop()
        lib().llama_memory_seq_rm(self.model.memory, seq_id, -1, -1)  # seq_cp does not clear its destination
        return seq_id

    def idle(self, pinned: Iterable[Seq] = (), spare: Iterable[Seq] = ()) -> list[Seq]:
        """The resident sequences room can be made from: neither ``pinned`` (the operation's own) nor held by a
        running call, unless ``spare`` names it (a decode's fork source: the call reads its cells through the fork,
        so a cut of a state that fills the pool can continue once the rest of it is spilled)."""
        keep = {id(s) for s in pinned} | (self.held - {id(s) for s in spare})
        return [s for s in self.resident.values() if id(s) not in keep]

    def _give_back(self, seq_id: int) -> None:
        """Return an id taken by :meth:`_acquire` that no sequence holds (a failed load): its cells cleared."""
        lib().llama_memory_seq_rm(self.model.memory, seq_id, -1, -1)
        self._free.append(seq_id)

    def new_seq(self, pinned: Iterable[Seq] = ()) -> Seq:
        """A new, empty resident sequence (spilling the least recently used idle one outside ``pinned`` when no id is
        free). Under the model's lock; no view holds it yet: :meth:`release_id` it if none will."""
        seq = Seq(self, self._acquire(pinned))
        self.resident[seq.id] = seq  # type: ignore[index]
        self._touch(seq)
        return seq

    def spill(self, seq: Seq) -> None:
        """Resident ``seq`` to host bytes (its ``blob``), its id and cells freed (:meth:`ensure_resident` restores it).
        Under the model's lock."""
        assert seq.id is not None
        if self.model.n_swa > 0 and not self.model.hybrid and seq.extent > seq.longest:
            window.cut_tail(self, seq, seq.longest)  # (its bytes hold the window behind the end: see window.py)
        seq.blob = seqbytes.get(self.model, seq.id)
        self.release_id(seq.id)
        seq.id = None
        self.spills += 1

    def ensure_resident(self, seq: Seq, pinned: Iterable[Seq] = ()) -> int:
        """``seq``'s id, restoring a spilled sequence into a free one. If llama.cpp refuses the bytes (no room in
        the KV cache: cell pressure) the id goes back to the free list and ``seq`` stays spilled, its blob intact,
        so it can be restored once there is room. Under the model's lock."""
        if seq.id is None:
            assert seq.blob is not None, "a sequence that is neither resident nor spilled"
            seq_id = self._acquire([seq, *pinned])
            try:
                relative, n = reshare.restore(self, seq_id, seq.blob, cells.content(seq), seq.extent, [seq, *pinned])
            except BackendError as exc:
                self._give_back(seq_id)
                raise KVCacheFullError(
                    f"no room to restore a spilled state of {seq.extent} tokens (n_ctx={self.model.n_ctx} cells "
                    "shared by every live state): load the model with a larger n_ctx, or keep fewer states alive"
                ) from exc
            except BaseException:
                self._give_back(seq_id)  # (otherwise every refused restore leaks an id, until none is left)
                raise
            seq.id, seq.blob = seq_id, None
            cells.restored(seq)  # (fresh cells: its prefix is no longer shared with its family)
            self.resident[seq_id] = seq
            self.restores += 1
            reshare.settle(self, seq, relative, n)
        self._touch(seq)
        return seq.id

    def write(self, seq_id: int, blob: bytes, cost: int, pinned: Iterable[Seq]) -> None:
        """Write ``blob`` (``cost`` cells) into the free id ``seq_id``: room first (the least recently used idle
        families outside ``pinned``, only as much as it takes; in the invariant mode its kept cells first), then the
        bytes; a refusal anyway (fragmentation) spills every idle sequence and tries once more. Raises llama.cpp's
        refusal (:class:`~continuum.errors.BackendError`) if that fails too; the id's cells are then empty."""
        cells.make_room(self, cost, pinned)
        try:
            seqbytes.set_(self.model, seq_id, blob)
        except BackendError:
            if not cells.spill_every_idle(self, pinned):
                raise
            seqbytes.set_(self.model, seq_id, blob)

    def spill_idle(self) -> int:
        """Spill every resident sequence to host bytes now (ids and cells freed); returns how many."""
        with self.model.lock:
            self.collect()
            seqs = list(self.resident.values())
            for seq in seqs:
                self.spill(seq)
            return len(seqs)

    # -- views ------------------------------------------------------------------------------------
    def empty(self) -> KVView:
        """A view with no cells (a state before its first decode)."""
        return KVView(self, None, 0)

    def check(self, view: KVView) -> None:
        """Raise :class:`~continuum.errors.BackendError` unless ``view`` is a live view of this pool."""
        if view.pool is not self:
            raise BackendError("a KV view of another llama.cpp model (or pool) was used here")
        if view.released:
            raise BackendError("this KV view was released")

    def slice(self, view: KVView, n: int) -> KVView:
        """The first ``n`` positions of ``view`` (the same sequence: no llama call)."""
        self.check(view)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= view.n_tokens:
            raise SlicingError(f"a KV view of {view.n_tokens} tokens cannot be cut to {n!r}")
        with self.model.lock:
            self.collect()
            return KVView(self, view.seq if n else None, n)

    def fork(self, view: KVView, n: int | None = None, pinned: Iterable[Seq] = ()) -> KVView:
        """A view of the first ``n`` (default all) positions of ``view`` on a new sequence, sharing its cells."""
        self.check(view)
        n = view.n_tokens if n is None else n
        if not 0 <= n <= view.n_tokens:
            raise SlicingError(f"a KV view of {view.n_tokens} tokens cannot be forked at {n}")
        if n == 0 or view.seq is None:
            return self.empty()
        with self.model.lock:
            self.collect()
            if not window.fits(self, self.ensure_resident(src := view.seq, pinned), n):  # (gaps.py)
                raise StaleWindowError(f"the sliding-window cells behind position {n} are gone: recompute the state")
            view = KVView(self, dst := self.new_seq([src, *pinned]), n)  # (held: a failed restore in share releases it)
            self.share(src, dst, n)
            return view

    def share(self, src: Seq, dst: Seq, n: int) -> None:
        """``dst`` (a new, empty sequence) holds ``src``'s first ``n`` positions: the cells shared (``seq_cp``, a bit
        per cell), counted once (``cells.forked``), and on a hybrid the recurrent summary at ``n`` restored (seq_cp
        copied ``src``'s latest). The one way a sequence is forked (views, decode's forks, token trees)."""
        lib().llama_memory_seq_cp(self.model.memory, src.id, dst.id, 0, n)
        dst.extent = n
        cells.forked(src, dst, n)
        if self.model.hybrid:
            recurrent.forked(self, src, dst, n)

    # -- sliding window ------------------------------------------------------------------------------
    def can_extend(self, view: KVView) -> bool:
        """True if tokens can be decoded after ``view`` against its own cells; False for a sliding-window state
        whose window cells were evicted (recompute it). Restores a spilled view."""
        self.check(view)
        if view.seq is None:
            return True
        with self.model.lock:
            self.collect()
            return window.fits(self, self.ensure_resident(view.seq), view.n_tokens)

    def positions(self, view: KVView) -> tuple[int, int]:
        """``(seq_pos_min, seq_pos_max)`` of the view's sequence as llama.cpp reports them ((-1, -1): no cells)."""
        self.check(view)
        if view.seq is None:
            return (-1, -1)
        with self.model.lock:
            self.collect()
            seq_id, L, mem = self.ensure_resident(view.seq), lib(), self.model.memory
            return int(L.llama_memory_seq_pos_min(mem, seq_id)), int(L.llama_memory_seq_pos_max(mem, seq_id))

    # -- bytes -------------------------------------------------------------------------------------
    def to_bytes(self, view: KVView) -> bytes:
        """llama.cpp's bytes of exactly the view's positions (``llama_state_seq_get_data``). Shared cells are
        written out; a sliding-window model writes only the window behind the end (the state can be extended
        after loading, not cut further back)."""
        self.check(view)
        if view.seq is None:
            return b""
        with self.model.lock:
            self.collect()
            seq = view.seq
            if seq.id is None and seq.extent == view.n_tokens and seq.blob is not None:
                return seq.blob
            self.ensure_resident(seq)
            if seq.extent == view.n_tokens:
                return seqbytes.get(self.model, seq.id)  # type: ignore[arg-type]
            tmp = self.fork(view, pinned=[seq])
            try:
                return seqbytes.get(self.model, tmp.seq.id)  # type: ignore[union-attr, arg-type]
            finally:
                tmp.release()
                self.collect()

    def from_bytes(self, blob: bytes, n_tokens: int) -> KVView:
        """A view on a new sequence loaded from :meth:`to_bytes` output of ``n_tokens`` positions.

        Raises :class:`~continuum.errors.BackendError` if llama.cpp refuses the bytes or they do not hold
        positions ``.. n_tokens-1`` (check the blob's origin first: ``fingerprint.py``)."""
        if n_tokens == 0:
            return self.empty()
        with self.model.lock:
            self.collect()
            seq_id = self._acquire()
            try:
                # (room as for a restore: in the invariant mode the released cells it keeps would refuse the bytes)
                self.write(seq_id, blob, n_tokens, ())
            except BaseException:
                self._give_back(seq_id)
                raise
            hi = int(lib().llama_memory_seq_pos_max(self.model.memory, seq_id))
            if hi != n_tokens - 1:
                self._give_back(seq_id)
                raise BackendError(f"the sequence bytes hold positions up to {hi}, not the {n_tokens} tokens of the state")
            seq = Seq(self, seq_id)
            seq.extent = n_tokens
            self.resident[seq_id] = seq
            self._touch(seq)
            return KVView(self, seq, n_tokens)
