"""What the decoding loop, the engine and the state algebra need from a model: the backend protocol.

transformers (:class:`continuum.models.hf.Transformers`) is one implementation; a second backend (llama.cpp,
``continuum/models/llamacpp/``) implements the same protocol, and nothing above ``models/`` asks which one it has.

A backend provides:

* **a forward over rows' uncached suffixes** (:meth:`Backend.forward`): the new columns of a batch of rows on top of
  their KV, with explicit attention masks and positions, returning the wanted logits and the new KV; the KV passed
  in is never changed (states are immutable);
* **one engine step** (:meth:`Backend.run_step`): every running call's :class:`~continuum.models.request.Request`
  of the step, run the backend's own way (transformers: merged forwards in slabs; llama.cpp: one ``llama_decode``
  with a sequence per row), each request getting its result or its own error;
* **the KV as a value** (:mod:`continuum.models.kv`): a :class:`~continuum.models.kv.KVHandle` (transformers'
  tensors in a ``TensorKV``, llama.cpp's sequence views in a ``SeqKV``), with select rows, crop, stack, finish and
  bytes;
* **the tokenizer** (:class:`continuum.models.tokenizer.Tokenizer`'s interface: encode, decode by bytes, every
  token's bytes, the end-of-generation ids, the outlines-core vocabulary and the llguidance tokenizer);
* **an identity** (``fingerprint``, ``same_model``): a KV computed by another model is never used (invariant 5).

A backend whose KV is torch tensors provides ``kv_from_tensors(layers) -> kv`` (a state file's or a stored part's
tensors as its handle: :func:`continuum.models.kv.from_tensors`); one whose KV is its own storage provides
``save_kv(kv) -> (tensors, meta)`` and ``load_kv(tensors, meta) -> kv`` for state files
(``continuum.state.persistence``; a file whose KV no backend method reads is recomputed), and a token tree's KV its
own ``gather_paths`` (:func:`continuum.models.kv.gather_paths`).

Example:
    >>> from continuum.models.protocol import Backend
    >>> isinstance(models.transformers("gpt2"), Backend)             # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..loop.engine import Engine
    from .capacity import Capacity
    from .request import Request

__all__ = ["Backend"]


@runtime_checkable
class Backend(Protocol):
    """A model as the library uses it (see the module docstring)."""

    tokenizer: Any  # the Tokenizer interface (continuum.models.tokenizer)
    context_length: int | None  # positions a row may hold (None: unbounded)
    tokens_computed: int  # positions computed so far (the benchmarks and tests read it)
    prefix_cache: Any  # the automatic prefix cache (its reuse, remember and settle are what the loop calls), or None
    kv_budget: int | None  # the most KV bytes running calls may reach (admission waits; a call beyond it alone is refused)
    world_size: int  # processes running this model together (tensor parallelism; 1 otherwise): every rank steps alike
    max_call_rows: int | None  # the most rows one call decodes at once (llama.cpp: its sequence ids); a list call with
    # more runs its prompts in turns (continuum.loop.turns); None: unbounded

    @property
    def fingerprint(self) -> Any:
        """What identifies the weights: a saved or foreign KV is used only on a model with the same one."""
        ...

    def same_model(self, other: Any) -> bool:
        """Whether a KV computed by ``other`` is valid on this model."""
        ...

    @property
    def engine(self) -> Engine:
        """The engine that runs every concurrent call's loop on this model, one step for all."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the loop's id, mask and position tensors go."""
        ...

    @property
    def vocab_size(self) -> int:
        """Rows of the output projection (the width of the logits)."""
        ...

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: Any, *,
                logits: str = "last", reserve: int = 0, allowed: torch.Tensor | None = None,
                outputs: torch.Tensor | None = None) -> tuple[torch.Tensor | None, Any]:
        """The new columns ``input_ids`` on top of ``cache``: the float32 logits of the last column (``"last"``), of
        every new column (``"all"``) or none (``"none"``), and the KV of every column; ``cache`` is not changed.
        With ``allowed`` (a token tree) and ``logits="all"``, ``outputs`` ``(rows, new)`` may say which nodes' logits
        are read: the others may be left uncomputed (NaN). ``logits="outputs"`` (with ``allowed`` and ``outputs``):
        only those nodes' logits, ``(outputs.sum(), vocab)``, row-major (row by row, each row's columns in order),
        no vocabulary-wide row for a node nobody reads (choice scoring on a large vocabulary)."""
        ...

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one position of one row takes (admission counts calls in them; 0 when the backend cannot tell)."""
        ...

    def forward_now(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: Any,
                    *, logits: str = "last", reserve: int = 0,
                    allowed: torch.Tensor | None = None, outputs: torch.Tensor | None = None) -> tuple[torch.Tensor | None, Any]:
        """:meth:`forward` at once, in this thread, alone: what the engine runs for a one-off forward its own
        driver makes inside a step (classifier-free guidance's branch), and what :meth:`forward` is without an
        engine."""
        ...

    def run_step(self, requests: list[Request], stats: dict) -> None:
        """Run one engine step's requests; set each one's ``result`` (logits, KV) or ``error``; move ``stats``. A
        request that finds no room in a fixed pool fails with ``KVCacheFullError`` or ``SequencesExhaustedError``
        (after the backend made what room it could from idle states): the engine then parks a call and runs it
        again (the scheduler's exception path, ``continuum.loop.scheduler``)."""
        ...

    def capacity(self, requests: list[Request]) -> Capacity | None:
        """A fixed KV pool's room now, ``requests``' KV held (:class:`~continuum.models.capacity.Capacity`: cells
        total, in use, held; ids), or None without one (transformers: ``kv_budget`` bounds admission instead). The
        scheduler plans every step from it (``continuum.loop.scheduler``)."""
        ...

    def step_need(self, request: Request) -> int:
        """Cells ``request`` adds to the pool in its step (its rows' new tokens, a tree's nodes, spilled states it
        continues, restored); 0 without a fixed pool."""
        ...

    def hold(self, requests: list[Request]) -> None:
        """The KV the running calls' requests hold (before and, once run, after their step) stays resident through
        the next :meth:`run_step`: room is made from everything else (user-held states, parked calls) first. A
        backend without a fixed pool does nothing."""
        ...
