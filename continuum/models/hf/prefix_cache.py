"""Automatic prefix cache: KV blocks of token prefixes, reused by every call on one model (off by default).

Turn it on with ``models.transformers(..., prefix_cache="512MiB")`` (or ``Transformers(hf_model,
hf_tokenizer, prefix_cache=2**29)``); ``model.prefix_cache.stats()`` and ``.clear()``.

How it works (vLLM's automatic prefix caching, in process):

* A row's real tokens are cut into fixed-size blocks of :attr:`PrefixCache.block_size` tokens.
  A block's key is its tokens plus its parent's key (a hash chain: the KV of a token depends on
  every token before it), so a block is found only behind the very same prefix. Only full blocks
  are kept. Entries are keyed by the tokens themselves (a dict compares them), never by a bare
  hash, so a collision cannot return another prefix's KV.
* A block holds compact copies of its columns' keys and values, one ``(heads, block, head_dim)``
  pair per layer on that layer's device: it never pins a state's larger storage, and nothing the
  cache holds is handed out (a hit is copied into the call's own new storage).
* The byte budget is a hard bound: a block is added only after least-recently-used blocks were
  evicted to make room, else it is not added. Only leaves are evicted (a block whose children are
  gone), and never a block a running call has pinned while copying it.
* The cache belongs to one model: the model's fingerprint, dtype and device are checked on every
  use, and a change (``model.model.double()``, new weights loaded in place are not detected, see
  :mod:`continuum.models.identity`) empties it.

The decoding loop consults it (``model.prefix_cache``, None when off: its ``reuse``, ``remember`` and ``settle``
methods, the same on every backend) in one place, before it prefills the uncached suffix
(``prefix_reuse.reuse``: each row's cache is extended by its longest cached prefix, rows may differ), and
adds what that prefill computed (``prefix_reuse.remember``). Results are those of a fresh forward (the same
keys and values, computed by the same model for the same tokens at the same positions).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ...errors import PrefixCacheArgumentError
from ..budget import parse_budget
from . import cache as kvcache
from . import prefix_reuse
from .tensorkv import layers_of

if TYPE_CHECKING:  # at run time state is imported where a state is built: continuum.models (which holds the
    from ...state import SequenceState  # prefix cache) is imported by state's own modules

__all__ = ["PrefixCache", "parse_budget"]

class _Block:
    """One cached block: its tokens' keys/values per layer, its place in the chain, its users."""

    __slots__ = ("id", "key", "parent", "kv", "nbytes", "children", "pins")

    def __init__(self, id: int, key: tuple, parent: _Block | None, kv: kvcache.KV):
        self.id, self.key, self.parent, self.kv = id, key, parent, kv
        self.nbytes = sum(t.numel() * t.element_size() for pair in kv for t in pair)
        self.children = 0  # cached blocks whose parent this is: only a block without any is evicted
        self.pins = 0  # running calls copying it right now: never evicted meanwhile


class PrefixCache:
    """Blocks of cached keys/values by token prefix, LRU under ``max_bytes`` (see the module docstring).

    Thread-safe: one lock guards the table (new blocks are copied in under it); a hit is copied into
    the call's storage outside it, with its blocks pinned.

    Example:
        >>> model = models.transformers("gpt2", prefix_cache="256MiB")        # doctest: +SKIP
        >>> gen = generate.text(model, samplers.greedy())                      # doctest: +SKIP
        >>> gen(few_shot + "Q1", max_tokens=8); gen(few_shot + "Q2", max_tokens=8)  # doctest: +SKIP
        >>> model.prefix_cache.stats()["tokens_reused"]                         # doctest: +SKIP
        592
    """

    def __init__(self, max_bytes: int, block_size: int = 16):
        if block_size < 1:
            raise PrefixCacheArgumentError(f"block_size must be >= 1 token, got {block_size}")
        self.max_bytes, self.block_size = int(max_bytes), int(block_size)
        self._lock = threading.Lock()
        self._blocks: OrderedDict[tuple, _Block] = OrderedDict()  # least recently used first
        self._identity: tuple | None = None
        self._next_id = 1
        self._bytes = 0
        self._counts = dict(hits=0, misses=0, tokens_reused=0, evictions=0)
        self._inflight: list[_Inflight] = []  # prefixes concurrent calls are computing right now

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PrefixCache({s['bytes'] / 2**20:.1f} of {s['max_bytes'] / 2**20:.1f} MiB, {s['entries']} blocks of "
                f"{self.block_size} tokens, {s['hits']} hits / {s['misses']} misses)")

    def stats(self) -> dict:
        """``hits``/``misses`` (rows looked up that did / did not reuse a block), ``tokens_reused``
        (positions not computed thanks to the cache), ``bytes`` (held, always <= ``max_bytes``),
        ``max_bytes``, ``entries`` (blocks), ``evictions``, ``block_size``."""
        with self._lock:
            return dict(self._counts, bytes=self._bytes, max_bytes=self.max_bytes, entries=len(self._blocks),
                        block_size=self.block_size)

    def clear(self) -> None:
        """Drop every block (the counters stay). A call copying a block right now keeps its copy."""
        with self._lock:
            self._drop_all()

    # -- what the decoding loop calls (the same three methods on every backend's prefix cache) ----------------
    def reuse(self, state: SequenceState, room: int = 0) -> SequenceState:
        """``state`` with each row's cache extended by its longest cached prefix (:func:`.prefix_reuse.reuse`)."""
        return prefix_reuse.reuse(state, room)

    def remember(self, model, ids: torch.Tensor, mask: torch.Tensor, kv: kvcache.KV, owner: int | None = None) -> None:
        """Keep the prefixes a prefill just computed (:func:`.prefix_reuse.remember`)."""
        prefix_reuse.remember(model, ids, mask, layers_of(kv), owner)

    # -- the table (every method below runs under self._lock) -------------------------------
    def _drop_all(self) -> None:
        self._blocks.clear()
        self._bytes = 0

    def _sync(self, identity: tuple) -> None:
        if identity != self._identity:  # another model, dtype or device: nothing cached is valid
            self._drop_all()
            self._identity = identity

    def _touch(self, chain: Sequence[_Block]) -> None:
        for block in reversed(chain):  # ancestors end up more recent than their descendants
            self._blocks.move_to_end(block.key)

    def _make_room(self, need: int) -> bool:
        while self._bytes + need > self.max_bytes:
            victim = next((b for b in self._blocks.values() if b.children == 0 and b.pins == 0), None)
            if victim is None:
                return False
            del self._blocks[victim.key]
            self._bytes -= victim.nbytes
            if victim.parent is not None:
                victim.parent.children -= 1
            self._counts["evictions"] += 1
        return True

    def _chain(self, tokens: Sequence[int], blocks: int) -> list[_Block]:
        chain: list[_Block] = []
        B = self.block_size
        for i in range(blocks):
            block = self._blocks.get((chain[-1].id if chain else 0, tuple(tokens[i * B:(i + 1) * B])))
            if block is None:
                break
            chain.append(block)
        return chain

    # -- what the decoding loop calls ------------------------------------------------------------
    def acquire(self, identity: tuple, tokens: Sequence[int], have: int) -> list[_Block]:
        """The pinned blocks of the longest cached prefix of ``tokens`` (full blocks only), when it
        is longer than the ``have`` tokens the row already has cached; else ``[]``. Counts a hit or
        a miss. Give the blocks back with :meth:`release` once copied."""
        with self._lock:
            self._sync(identity)
            chain = self._chain(tokens, len(tokens) // self.block_size)
            if len(chain) * self.block_size <= have:
                self._counts["misses"] += 1
                return []
            self._touch(chain)
            for block in chain:
                block.pins += 1
            self._counts["hits"] += 1
            self._counts["tokens_reused"] += len(chain) * self.block_size - have
            return chain

    def computing(self, tokens: Sequence[int], covered: int) -> _Inflight | None:
        """In-batch sharing: a prefix another thread is computing right now that covers more full
        blocks of ``tokens`` than the ``covered`` tokens this row already has (the caller waits for
        it, then looks again). Else ``tokens`` is registered as computed by this thread (until
        :meth:`settle`), and None is returned."""
        B, me = self.block_size, threading.get_ident()
        tokens = tuple(tokens[:len(tokens) // B * B])
        with self._lock:
            for entry in self._inflight:
                if entry.thread != me and len(tokens) > covered and _shared_blocks(entry.tokens, tokens, B) * B > covered:
                    return entry
            if len(tokens) > covered:
                self._inflight.append(_Inflight(tokens, me))
        return None

    def settle(self, owner: int | None = None) -> None:
        """The prefixes registered by thread ``owner`` (default: this one) are computed (and inserted) or
        abandoned: wake the calls waiting for them. (A call's loop runs in the engine's thread: it names
        the thread that registered its prefixes.)"""
        me = self._inflight and (owner if owner is not None else threading.get_ident())
        if not me:
            return
        with self._lock:
            mine = [e for e in self._inflight if e.thread == me]
            self._inflight = [e for e in self._inflight if e.thread != me]
        for entry in mine:
            entry.done.set()

    def release(self, chain: Sequence[_Block]) -> None:
        with self._lock:
            for block in chain:
                block.pins -= 1

    def insert(self, identity: tuple, tokens: Sequence[int], kv: kvcache.KV, row: int, columns: torch.Tensor) -> int:
        """Add the full blocks of ``tokens`` not cached yet; their keys/values are row ``row`` of
        ``kv`` at ``columns`` (one column per token). Returns how many blocks were added (adding
        stops when the budget cannot make room)."""
        B = self.block_size
        added = 0
        with self._lock:
            self._sync(identity)
            chain = self._chain(tokens, len(tokens) // B)
            for block in chain:
                block.pins += 1  # the chain being extended must stay while LRU blocks are evicted
            need = self.block_bytes(kv)
            try:
                for i in range(len(chain), len(tokens) // B):
                    if need > self.max_bytes or not self._make_room(need):  # room first, then copy
                        break
                    cols = columns[i * B:(i + 1) * B]
                    start = int(cols[0])
                    contiguous = int(cols[-1]) - start == B - 1
                    copy = tuple((k[row, :, start:start + B].clone() if contiguous else k[row].index_select(1, cols),
                                  v[row, :, start:start + B].clone() if contiguous else v[row].index_select(1, cols))
                                 for k, v in kv)
                    parent = chain[-1] if chain else None
                    block = _Block(self._next_id, (parent.id if parent else 0, tuple(tokens[i * B:(i + 1) * B])), parent, copy)
                    self._next_id += 1
                    self._blocks[block.key] = block
                    self._bytes += block.nbytes
                    if parent is not None:
                        parent.children += 1
                    block.pins += 1
                    chain.append(block)
                    added += 1
                self._touch(chain)
            finally:
                for block in chain:
                    block.pins -= 1
        return added

    def block_bytes(self, kv: kvcache.KV) -> int:
        """Bytes one block of ``kv``'s layers would take."""
        return sum(2 * k.shape[1] * self.block_size * k.shape[3] * k.element_size() for k, _ in kv)


class _Inflight:
    """A prefix (full blocks of tokens) that one thread's prefill is computing; others wait for ``done``."""

    __slots__ = ("tokens", "thread", "done")

    def __init__(self, tokens: tuple, thread: int):
        self.tokens, self.thread, self.done = tokens, thread, threading.Event()


def _shared_blocks(a: tuple, b: tuple, B: int) -> int:
    n = 0
    while (n + 1) * B <= min(len(a), len(b)) and a[n * B:(n + 1) * B] == b[n * B:(n + 1) * B]:
        n += 1
    return n
