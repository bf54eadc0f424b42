"""Model adapter around a Hugging Face causal LM.

The adapter owns exactly one job: run the model on the uncached columns of a batch, with an
explicit attention mask and explicit ``position_ids`` (GPT-2 gives wrong logits for
left-padded rows without them), and hand back the last position's logits and the new KV tensors.
"""

from __future__ import annotations

import threading
from functools import cached_property
from typing import Any

import torch

from ..cache import KV, from_dynamic_cache, layer_kinds, to_dynamic_cache
from ..errors import ContinuumError
from ..prefix_cache import PrefixCache, parse_budget
from .identity import ModelFingerprint, fingerprint_of
from .tokenizer import Tokenizer

__all__ = ["Transformers", "transformers"]


class Transformers:
    """A Hugging Face causal language model and its tokenizer.

    Args:
        model: a loaded ``PreTrainedModel`` with a causal LM head (GPT-2, Llama, Mistral, Qwen...).
        tokenizer: its ``PreTrainedTokenizer``; given no pad token, its EOS token is used.
        prefix_cache: byte budget of the automatic prefix cache (an int, or ``"512MiB"``, ``"2GB"``);
            ``None``/``0`` (default): off. See :mod:`continuum.prefix_cache` and ``docs/prefix_cache.md``.

    Example:
        >>> from transformers import AutoModelForCausalLM, AutoTokenizer
        >>> hf = AutoModelForCausalLM.from_pretrained("gpt2")          # doctest: +SKIP
        >>> model = Transformers(hf, AutoTokenizer.from_pretrained("gpt2"))  # doctest: +SKIP
    """

    def __init__(self, model: Any, tokenizer: Any, prefix_cache: int | str | None = None):
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
        # Sliding-window layers: the window must be measured in positions, not columns (a state's
        # cached layout has holes where text was cut), so such models get explicit 4-D masks.
        _, sliding = layer_kinds(self.config)
        self._window: int | None = getattr(text_cfg, "sliding_window", None) if sliding else None
        self._per_layer_masks = sliding and bool(getattr(text_cfg, "layer_types", None))
        self.tokens_computed = 0  # total positions passed to forward: benchmarks read it
        self.forward_calls = 0
        self._count_lock = threading.Lock()  # threads share one adapter: `+=` on an attribute is not atomic
        self._kv_dtypes: dict[torch.dtype, torch.dtype] = {}  # weights dtype -> KV dtype seen in forward
        budget = parse_budget(prefix_cache)  # checked before anything is built on the model
        self.prefix_cache: PrefixCache | None = PrefixCache(budget) if budget else None

    # -- identity -------------------------------------------------------------------------
    @cached_property
    def fingerprint(self) -> ModelFingerprint:
        """Architecture, config hash and a cheap weights hash (see ``continuum.models.identity``).

        Computed once, on first use: weights changed in place afterwards are not re-detected.
        """
        return fingerprint_of(self.model)

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
        dtype = self.model.dtype
        return self._kv_dtypes.get(dtype, dtype)

    def __repr__(self) -> str:
        return f"Transformers({type(self.model).__name__}, {self.tokenizer!r})"

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KV | None,
        *,
        logits: str = "last",
        reserve: int = 0,
    ) -> tuple[torch.Tensor | None, KV]:
        """Run ``input_ids`` (the uncached columns) on top of ``cache``.

        ``attention_mask`` covers cached + new columns (zeros anywhere are fine).
        Returns the logits (float32) of the last column ``(rows, vocab)`` (``logits="last"``), of
        every new column ``(rows, new, vocab)`` (``"all"``) or ``None`` (``"none"``), and the KV
        tensors covering all columns. ``cache`` is not modified. ``reserve``: columns the caller will
        append after this call (decoding steps to come), so the KV storage is allocated once.
        """
        past = to_dynamic_cache(cache, self.config, reserve)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask if self._window is None else self._window_masks(attention_mask, input_ids.shape[1]),
            position_ids=position_ids,
            past_key_values=past,
            use_cache=True,
            logits_to_keep=0 if logits == "all" else 1,
        )
        with self._count_lock:
            self.tokens_computed += input_ids.numel()
            self.forward_calls += 1
        result = {"last": lambda: out.logits[:, -1, :].float(), "all": lambda: out.logits.float(), "none": lambda: None}[logits]()
        kv = from_dynamic_cache(out.past_key_values)
        if cache is None and kv:  # a cache computed from scratch: remember what dtype these weights produce
            self._kv_dtypes[self.model.dtype] = kv[0][0].dtype
        return result, kv


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
        sliding = causal & (dist < self._window)
        low = torch.finfo(self.model.dtype).min

        def additive(allowed: torch.Tensor) -> torch.Tensor:
            return torch.zeros(allowed.shape, dtype=self.model.dtype, device=mask.device).masked_fill_(~allowed, low)[:, None]

        if not self._per_layer_masks:  # every layer slides (Mistral-style configs)
            return additive(sliding)
        return {"full_attention": additive(causal), "sliding_attention": additive(sliding)}


def transformers(model_name: str, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                 prefix_cache: int | str | None = None, **kwargs: Any) -> Transformers:
    """Load a causal LM and its tokenizer with ``from_pretrained`` and wrap them.

    Args:
        model_name: a hub id or a local folder.
        device: where to put the model (default: CPU).
        dtype: the weights' dtype (default: the checkpoint's).
        prefix_cache: byte budget of the automatic prefix cache (``"512MiB"``, ``"2GB"``, an int); off by default.
        **kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parse_budget(prefix_cache)  # a bad budget fails before anything is loaded
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name)
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype if dtype is not None else "auto", **kwargs)
    except OSError as exc:
        raise ContinuumError(f"Could not load {model_name!r}: {exc}") from exc
    if device is not None:
        model = model.to(device)
    return Transformers(model, tokenizer, prefix_cache=prefix_cache)
