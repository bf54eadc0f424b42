"""Model adapter around a Hugging Face causal LM.

The adapter owns exactly one job: run the model on the uncached columns of a batch, with an
explicit attention mask and explicit ``position_ids`` (GPT-2 gives wrong logits for
left-padded rows without them), and hand back the last position's logits and the new KV tensors.
"""

from __future__ import annotations

import threading
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from ..identity import ModelFingerprint, fingerprint_of
from ..request import compact_outputs
from ..tokenizer import Tokenizer
from . import hybrid
from .cache import to_devices
from .dynamic import cache_kwargs, from_dynamic_cache, layer_kinds, to_dynamic_cache
from .hybrid import HybridSpec, spec_of
from .prefix_cache import PrefixCache, parse_budget
from .tensorkv import TensorKV, layers_of, wrap

if TYPE_CHECKING:
    from ...loop.engine import Engine

__all__ = ["Transformers"]


class Transformers:
    """A Hugging Face causal language model and its tokenizer.

    Args:
        model: a loaded ``PreTrainedModel`` with a causal LM head (GPT-2, Llama, Mistral, Qwen...).
        tokenizer: its ``PreTrainedTokenizer``; given no pad token, its EOS token is used.
        prefix_cache: byte budget of the automatic prefix cache (an int, or ``"512MiB"``, ``"2GB"``);
            ``None``/``0`` (default): off. See :mod:`continuum.models.hf.prefix_cache` and ``docs/prefix_cache.md``.

    Example:
        >>> from transformers import AutoModelForCausalLM, AutoTokenizer
        >>> hf = AutoModelForCausalLM.from_pretrained("gpt2")          # doctest: +SKIP
        >>> model = Transformers(hf, AutoTokenizer.from_pretrained("gpt2"))  # doctest: +SKIP
    """

    def __init__(self, model: Any, tokenizer: Any, prefix_cache: int | str | None = None, kv_budget: int | str | None = None):
        self.kv_budget: int | None = parse_budget(kv_budget, "kv_budget")  # (the engine's max_kv_bytes; checked first)
        self.max_call_rows: int | None = None  # (rows are tensors: no bound of the backend's own)
        self.model = model.eval()
        gen_cfg = getattr(model, "generation_config", None)
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(
            tokenizer, getattr(gen_cfg, "eos_token_id", None)
        )
        self.config = model.config
        text_cfg = self.config.get_text_config(decoder=True) if hasattr(self.config, "get_text_config") else self.config
        self.context_length: int | None = getattr(text_cfg, "max_position_embeddings", None) or getattr(
            text_cfg, "n_positions", None
        )
        # Recurrent layers (LFM2, Mamba): the KV is a HybridKV and forwards go through hybrid.py (docs/hybrid.md).
        self.hybrid: HybridSpec | None = spec_of(text_cfg, prefix_cache=prefix_cache)
        self.snapshot_interval: int | None = None  # hybrid models: a summary kept every N decoded columns too
        # Sliding-window layers: the window must be measured in positions, not columns (a state's
        # cached layout has holes where text was cut), so such models get explicit 4-D masks.
        _, sliding = layer_kinds(self.config)
        self._window: int | None = getattr(text_cfg, "sliding_window", None) if sliding else None
        self._per_layer_masks = sliding and bool(getattr(text_cfg, "layer_types", None))
        self.tokens_computed = 0  # total positions passed to forward: benchmarks read it
        self.forward_calls = 0
        self._count_lock = threading.Lock()  # threads share one adapter: `+=` on an attribute is not atomic
        self._kv_dtypes: dict[torch.dtype, torch.dtype] = {}  # weights dtype -> KV dtype seen in forward
        self._kv_bytes: dict[int, int] = {}  # KV bytes per token, per KV dtype size (kv_bytes_per_token)
        self._layer_devices: tuple | None = None  # ((device, device map), each layer's KV device): layer_devices
        budget = parse_budget(prefix_cache)  # checked before anything is built on the model
        self.prefix_cache: PrefixCache | None = PrefixCache(budget) if budget else None

    # -- identity -------------------------------------------------------------------------
    @cached_property
    def fingerprint(self) -> ModelFingerprint:
        """Architecture, config hash and a cheap weights hash (see ``continuum.models.identity``).

        Computed once, on first use: weights changed in place afterwards are not re-detected.
        """
        return fingerprint_of(self.model)

    @property
    def world_size(self) -> int:
        """Tensor-parallel processes sharing this model (transformers' ``tp_plan``; 1 without one)."""
        return getattr(self.model, "_tp_size", None) or 1

    def same_model(self, other: Any) -> bool:
        """Whether a KV cache computed by ``other`` is valid for this model.

        Instant for the same adapter or the same wrapped module; otherwise compares fingerprints
        (each computed once per adapter).

        Example:
            >>> model.same_model(model)                       # doctest: +SKIP
            True
        """
        if other is self:
            return True
        if not isinstance(other, Transformers):
            return False
        return other.model is self.model or other.fingerprint == self.fingerprint

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the KV tensors this model produces with its current weights.

        Learned from the forward passes (mixed-precision models may keep a KV dtype other than
        ``model.dtype``); before any, the weights' dtype. A state whose cache has another dtype
        (e.g. made before ``model.model.double()``) is recomputed when it is continued.
        """
        dtype = self._weights_dtype()
        return self._kv_dtypes.get(dtype, dtype)

    def _weights_dtype(self) -> torch.dtype:
        """``self.model.dtype`` (the first floating-point parameter's dtype), read from that parameter itself: HF's
        property walks the module's parameters on every read, and every call asks (a few times). ``.double()``,
        ``.half()`` and ``.to()`` change a parameter's data in place, so the remembered one follows them."""
        p = self._float_param
        return p.dtype if p is not None else self.model.dtype

    @cached_property
    def _float_param(self) -> torch.nn.Parameter | None:
        return next((q for q in self.model.parameters() if q.is_floating_point()), None)

    @cached_property
    def _first_param(self) -> torch.nn.Parameter | None:
        return next(self.model.parameters(), None)

    def __repr__(self) -> str:
        return f"Transformers({type(self.model).__name__}, {self.tokenizer!r})"

    def capacity(self, requests: list) -> None:
        """No fixed pool (tensors are allocated as needed): the scheduler admits by rows and ``kv_budget`` alone."""
        return None

    def step_need(self, request: Any) -> int:
        return 0

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one position of one row takes (every layer's keys and values), from the config and the KV dtype
        (0 when the config does not say; a hybrid model's attention layers only: its snapshots are per row)."""
        from ..memory import config_kv_bytes_per_token

        size = self.kv_dtype.itemsize
        if size not in self._kv_bytes:  # (per KV dtype: the config does not change)
            per = config_kv_bytes_per_token(self.model.config, size)
            self._kv_bytes[size] = per if self.hybrid is None else per * len(self.hybrid.attn) // max(self._layers, 1)
        return self._kv_bytes[size]

    @property
    def device(self) -> torch.device:
        """``self.model.device`` (its first parameter's), read from that parameter (see :meth:`_weights_dtype`)."""
        p = self._first_param
        return p.device if p is not None else self.model.device

    @property
    def layer_devices(self) -> tuple[torch.device, ...]:
        """The device of each layer's KV cache: the device of that decoder layer under a ``device_map``
        that spreads layers (accelerate's execution device for offloaded ones), else ``self.device``.
        Inputs (ids, masks, positions) go to ``self.device``, where the embeddings are."""
        device, spread = self.device, getattr(self.model, "hf_device_map", None)
        key = (device, id(spread))  # (every call's input is checked against it: read again only if the weights moved)
        if self._layer_devices is not None and self._layer_devices[0] == key:
            return self._layer_devices[1]
        n, _ = layer_kinds(self.config)
        blocks = self._decoder_layers(n) if spread and len({str(d) for d in spread.values()}) > 1 else None
        found = tuple(_execution_device(block, device) for block in blocks) if blocks else (device,) * n
        self._layer_devices = (key, found)
        return found

    def _decoder_layers(self, n: int) -> list | None:
        """The model's list of ``n`` decoder layers (``model.layers``, ``transformer.h``...), found once."""
        if not hasattr(self, "_blocks"):
            self._blocks = next((list(m) for m in self.model.modules()
                                 if isinstance(m, torch.nn.ModuleList) and len(m) == n), None)
        return self._blocks

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def engine(self) -> Engine:
        """The engine that runs the decode loop of every concurrent call on this model, one step for all
        (created on first use; ``model.scheduler`` is the same object).

        ``model.engine.max_rows`` bounds the rows of calls decoding at once (default 256), ``max_kv_bytes``
        their KV cache (default None), ``prefill_chunk`` a newcomer's prefill per step (default 512 columns);
        ``model.engine.stats()`` counts steps and merged forwards and reports padding and step times.
        See ``docs/scheduler.md``.
        """
        engine = self.__dict__.get("_engine")
        if engine is None:
            with self._count_lock:
                engine = self.__dict__.get("_engine")
                if engine is None:
                    from ...loop.engine import Engine

                    engine = self.__dict__["_engine"] = Engine(self, max_kv_bytes=self.kv_budget)
        return engine

    scheduler = engine  # (the name of earlier releases)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: TensorKV | None,
        *,
        logits: str = "last",
        reserve: int = 0,
        allowed: torch.Tensor | None = None,
        outputs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, TensorKV | None]:
        """Run ``input_ids`` (the uncached columns) on top of ``cache``.

        ``attention_mask`` covers cached + new columns (zeros anywhere are fine).
        Returns the logits (float32) of the last column ``(rows, vocab)`` (``logits="last"``), of
        every new column ``(rows, new, vocab)`` (``"all"``) or ``None`` (``"none"``), and the KV
        covering all columns (:class:`~.tensorkv.TensorKV`; a hybrid model's :class:`~.recurrent.HybridKV`).
        ``cache`` is not modified. ``reserve``: columns the caller will append after this call (decoding steps to
        come), so the KV storage is allocated once.
        ``allowed``: a boolean ``(rows, new, cached + new)`` matrix, which columns each new column
        attends to, instead of "every real column up to itself" (a token tree: options scored side
        by side after one context, see :mod:`continuum.loop.scoring`); ``position_ids`` then say where
        each new column sits. The sliding window, when the model has one, still applies by position.
        ``outputs``: with ``allowed`` and ``logits="all"``, which columns' logits are read ``(rows, new)``: only
        those columns get the output projection, the others are NaN (:meth:`_run`).

        While other calls decode on this model (other threads), the forward is merged with theirs
        (:mod:`continuum.loop.engine`); the result is the same.
        """
        engine = self.__dict__.get("_engine")
        if engine is not None:
            return engine.forward(input_ids, attention_mask, position_ids, cache, logits, reserve, allowed, outputs)
        return self.forward_now(input_ids, attention_mask, position_ids, cache, logits=logits, reserve=reserve,
                                   allowed=allowed, outputs=outputs)

    def run_step(self, requests: list, stats: dict) -> None:
        """Run one engine step's forward requests (:class:`~continuum.models.request.Request`): merged forwards by
        group in shared slabs, the rest alone; each request gets its result or its own error (the backend protocol,
        :mod:`continuum.models.protocol`)."""
        from .step import run_requests

        run_requests(self, requests, stats)

    def hold(self, requests: list) -> None:
        """Nothing to hold: the KV lives in tensors, not in a fixed pool (the backend protocol)."""

    @torch.inference_mode()
    def forward_now(self, input_ids, attention_mask, position_ids, cache, *, logits="last", reserve=0, allowed=None,
                    outputs=None):
        """:meth:`forward` for one call, on a fresh ``DynamicCache`` wrapping ``cache``'s tensors."""
        if self.hybrid is not None:
            lg, kv = hybrid.forward(self, self.hybrid, input_ids, attention_mask, position_ids, cache,
                                    logits="all" if logits == "outputs" else logits, reserve=reserve, allowed=allowed)
            return (compact_outputs(lg, outputs) if logits == "outputs" else lg), kv
        past = to_dynamic_cache(layers_of(cache), self.config, reserve)
        out = self._run(input_ids, attention_mask, position_ids, past, logits, allowed,
                        outputs if allowed is not None and logits in ("all", "outputs") else None)
        with self._count_lock:
            self.tokens_computed += input_ids.numel()
        result = {"last": lambda: out[:, -1, :], "all": lambda: out, "outputs": lambda: out,
                  "none": lambda: None}[logits]()
        kv = from_dynamic_cache(past)
        if cache is None and kv:  # a cache computed from scratch: remember what dtype these weights produce
            self._kv_dtypes[self.model.dtype] = kv[0][0].dtype
        return result, wrap(kv or None)

    def kv_from_tensors(self, layers) -> TensorKV:
        """The KV handle over per-layer ``(keys, values)`` (a state file's, a stored part's), each layer on its
        layer's device (a ``device_map``)."""
        if len(layers) == len(self.layer_devices):
            layers = to_devices(layers, self.layer_devices)
        return TensorKV(layers)

    def save_kv(self, kv) -> tuple[dict, dict]:
        """A hybrid model's KV for a state file (:func:`continuum.models.hf.hybrid.save_kv`)."""
        return hybrid.save_kv(kv)

    def load_kv(self, tensors: dict, meta: dict):
        """The KV :meth:`save_kv` wrote, on this model's device."""
        return hybrid.load_kv(tensors, meta, self.device)

    def _run(self, input_ids, attention_mask, position_ids, past, logits: str, allowed=None, outputs=None) -> torch.Tensor:
        """One model forward on the ``Cache`` object ``past``; the float32 logits of the last column
        (``logits`` "last" or "none": shape ``(rows, 1, vocab)``) or of every new column; ``allowed``: see
        :meth:`forward`. ``outputs`` ``(rows, new)``: only the columns some row reads get the output projection (a
        token tree's trunk and leaves are not read; on a large vocabulary each column's projection costs about what its
        layers do), the others are NaN; with ``logits="outputs"`` only the read ones are returned, ``(read, vocab)``
        row-major."""
        if allowed is not None:
            mask: Any = self._tree_masks(attention_mask, position_ids, allowed)
        elif self._window is not None:
            mask = self._window_masks(attention_mask, input_ids.shape[1])
        else:
            mask = attention_mask
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            **cache_kwargs(self.model, past),
            use_cache=True,
            logits_to_keep=keep if (keep := _kept(outputs)) is not None else (0 if logits in ("all", "outputs") else 1),
        )
        with self._count_lock:
            self.forward_calls += 1
        if logits == "outputs":  # (the kept columns' rows that are read, row-major)
            return compact_outputs(out.logits, outputs if outputs is None or keep is None else outputs[:, keep]).float()
        if keep is None:
            return out.logits.float()
        full = torch.full((*input_ids.shape, out.logits.shape[-1]), float("nan"), device=out.logits.device)
        full[:, keep] = out.logits.float()
        return full

    @property
    def _layers(self) -> int:
        return layer_kinds(self.config)[0]

    def _window_masks(self, mask: torch.Tensor, new: int):
        """4-D additive masks ``(rows, 1, new, columns)`` for models with sliding-window layers.

        A key is visible to a query when it is a real token at a position <= the query's, and, for
        sliding layers, less than ``sliding_window`` positions back. Positions count real tokens,
        so holes and padding never use up the window (Hugging Face counts columns, which is the
        same thing only for compact left-padded rows). Models with per-layer ``layer_types`` get a
        dict of masks, as their forward accepts.
        """
        pos = mask.cumsum(1) - 1
        dist = pos[:, -new:, None] - pos[:, None, :]
        causal = mask.bool()[:, None, :] & (dist >= 0)
        return self._additive(causal, causal & (dist < self._window) if self._window is not None else None)

    def _tree_masks(self, mask: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor):
        """The 4-D additive mask(s) of an explicit ``allowed`` matrix ``(rows, new, columns)``; with a
        sliding window, a key also needs to be less than ``sliding_window`` positions back (cached
        columns' positions from ``mask``, new columns' from ``position_ids``)."""
        allowed = allowed.to(mask.device, torch.bool)
        if self._window is None:
            return self._additive(allowed, None)
        new = position_ids.shape[1]
        cached = (mask[:, :mask.shape[1] - new].cumsum(1) - 1).clamp(min=0)
        pos = torch.cat([cached, position_ids.to(cached.device)], 1)
        dist = position_ids.to(pos.device)[:, :, None] - pos[:, None, :]
        return self._additive(allowed, allowed & (dist < self._window))

    def _additive(self, full: torch.Tensor, sliding: torch.Tensor | None):
        """Boolean ``(rows, new, columns)`` masks as the additive ``(rows, 1, new, columns)`` masks the model
        takes: the sliding one for models whose every layer slides, a dict per layer kind for mixed ones."""
        low = torch.finfo(self.model.dtype).min

        def additive(allowed: torch.Tensor) -> torch.Tensor:
            return torch.zeros(allowed.shape, dtype=self.model.dtype, device=allowed.device).masked_fill_(~allowed, low)[:, None]

        if sliding is None:
            return additive(full)
        if not self._per_layer_masks:  # every layer slides (Mistral-style configs)
            return additive(sliding)
        return {"full_attention": additive(full), "sliding_attention": additive(sliding)}


def _execution_device(module: torch.nn.Module, default: torch.device) -> torch.device:
    """Where ``module`` computes: accelerate's hook device when it has one (offloaded weights sit on ``meta``
    or the CPU between calls), else the device of its first parameter."""
    hooked = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if hooked is not None:
        return torch.device(hooked if not isinstance(hooked, int) else f"cuda:{hooked}")
    param = next(module.parameters(), None)
    return param.device if param is not None else default


def _kept(outputs: torch.Tensor | None) -> torch.Tensor | None:
    """The columns whose logits some row reads (``outputs`` ``(rows, new)``), or None: every column."""
    if outputs is None:
        return None
    keep = outputs.bool().any(0).nonzero().flatten()
    return keep if len(keep) < outputs.shape[1] else None
