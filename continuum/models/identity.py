"""Model identity: which network computed a KV cache.

A KV cache is only valid under the model that computed it. Two adapters are the *same model* when
they wrap the same Hugging Face module, or when their :class:`ModelFingerprint` (architecture, a
hash of the config, a cheap hash of the weights, and the parallel layout) is equal. The weights hash reads a few fixed
elements of every parameter tensor (start, middle and end) and the first and last rows of the
embeddings, in their stored dtype: cheap for any model size (one small copy per device), and any
fine-tune, LoRA merge, re-seeded init or dtype change moves some of those elements.

It is computed once per adapter and cached: weights changed *in place* after the first use
(``param.data.mul_(2)``, ``model.double()``...) are not re-detected by the fingerprint. A dtype change
is still caught when a state is continued (see ``SequenceState.to_model``).

Parallel layout: under tensor parallelism (``tp_plan`` under torchrun) each process holds a slice of
every layer's heads, so its KV cache holds only its heads and is valid only for the same rank of the
same layout. The fingerprint records the world size, the rank and the plan; the weights hash reads
this rank's shards (no communication: computing it is never a collective that other ranks must join).

Example:
    >>> fp = model.fingerprint                    # doctest: +SKIP
    >>> fp.architecture, fp.config[:8], fp.weights[:8]   # doctest: +SKIP
    ('LlamaForCausalLM', '3f1c2a9e', 'b07d41c2')
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["ModelFingerprint", "fingerprint_of", "config_hash", "weights_hash", "parallel_layout"]

# Config keys that describe how a model was loaded or is run, not what it computes.
_VOLATILE_KEYS = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "dtype", "torch_dtype", "architectures",
    "_attn_implementation", "_attn_implementation_autoset", "_attn_implementation_internal", "attn_implementation",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript", "_experts_implementation",
    "distributed_config",  # the layout is recorded on its own (ModelFingerprint.world_size, rank, tp_plan)
})
_SLICE = 8  # elements read at the start, the middle and the end of every parameter


@dataclass(frozen=True)
class ModelFingerprint:
    """What a saved state records about the model that computed its cache.

    Attributes:
        architecture: the model class name (``LlamaForCausalLM``).
        config: a hash of the config dict (without load-time keys such as the path or dtype).
        weights: a hash of fixed slices of the weights (this rank's shards under tensor parallelism).
        world_size: the number of tensor-parallel processes (1: a single process, device maps included).
        rank: this process's rank among them (0 in a single process).
        tp_plan: the tensor-parallel plan, as ``"auto:<hash>"`` / ``"custom:<hash>"`` of the plan
            applied, or None in a single process.
    """

    architecture: str
    config: str
    weights: str
    world_size: int = 1
    rank: int = 0
    tp_plan: str | None = None

    @classmethod
    def from_dict(cls, saved: dict) -> ModelFingerprint:
        """The fingerprint a file recorded; files saved before layouts were recorded were single-process."""
        return cls(**{k: saved[k] for k in ("architecture", "config", "weights", "world_size", "rank", "tp_plan") if k in saved})

    @property
    def layout(self) -> str:
        """``"single process"`` or ``"rank R of N (tp_plan P)"``, for messages."""
        return "single process" if self.world_size == 1 else f"rank {self.rank} of {self.world_size} (tp_plan {self.tp_plan})"

    def as_dict(self) -> dict[str, str]:
        # (every field is a str, an int or None: a shallow dict is the whole copy. dataclasses.asdict deep-copies each
        # value, ~45 us, and every stored state's metadata asks for it: a remote call's store write, B30)
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _VOLATILE_KEYS}
    if isinstance(value, (list, tuple)):
        return [_strip(v) for v in value]
    return value


def config_hash(config: Any) -> str:
    """A hash of ``config.to_dict()`` without the keys that vary with how the model was loaded."""
    payload = json.dumps(_strip(config.to_dict()), sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel ``DTensor`` (no communication); any other tensor as is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def weights_hash(module: PreTrainedModel) -> str:
    """A hash of a few fixed elements of every parameter and of the embeddings' first and last rows."""
    h = hashlib.sha256()
    slices: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}

    def take(t: torch.Tensor) -> None:
        t = _local(t)
        if t.device.type == "meta" or t.numel() == 0:
            return
        slices.setdefault((t.device, t.dtype), []).append(t.reshape(-1))

    with torch.no_grad():
        for name, param in module.named_parameters():
            h.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
            p = _local(param)
            flat = p.detach().reshape(-1) if p.is_contiguous() else p.detach()[(0,) * (p.dim() - 1)]
            n = flat.numel()
            for start in (0, max(0, n // 2 - _SLICE // 2), max(0, n - _SLICE)):
                take(flat[start:start + _SLICE])
        for emb in (module.get_input_embeddings(), module.get_output_embeddings()):
            w = getattr(emb, "weight", None)
            if w is not None and w.dim() == 2:
                take(w.detach()[0])
                take(w.detach()[-1])
        for (_device, dtype), parts in sorted(slices.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
            data = torch.cat(parts).cpu().contiguous()
            h.update(f"{dtype}".encode())
            h.update(data.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def parallel_layout(module: torch.nn.Module) -> tuple[int, int, str | None]:
    """(world size, rank, plan) of a model loaded with tensor parallelism; ``(1, 0, None)`` otherwise."""
    world = getattr(module, "_tp_size", None) or 1
    if world <= 1:
        return 1, 0, None
    mesh: Any = getattr(module, "_device_mesh", None)  # None: the TypeError below is caught
    try:
        rank = mesh["tp"].get_local_rank()
    except Exception:  # a mesh without a "tp" dimension name: the global rank is the tp rank
        import torch.distributed as dist

        rank = dist.get_rank()
    dist_cfg = getattr(module.config, "distributed_config", None)
    name = getattr(dist_cfg, "tp_plan", None)
    plan = json.dumps(getattr(module, "_tp_plan", None) or {}, sort_keys=True, default=str)
    return world, rank, f"{name if isinstance(name, str) else 'custom'}:{hashlib.sha256(plan.encode()).hexdigest()[:8]}"


def fingerprint_of(module: PreTrainedModel) -> ModelFingerprint:
    """The :class:`ModelFingerprint` of a Hugging Face ``PreTrainedModel`` (its parallel layout included)."""
    world, rank, plan = parallel_layout(module)
    return ModelFingerprint(type(module).__name__, config_hash(module.config), weights_hash(module), world, rank, plan)
