"""``models.transformers(name)``: load a causal LM and its tokenizer with ``from_pretrained`` (one device, a
``device_map`` or tensor parallelism) and wrap them in :class:`~continuum.models.hf.model.Transformers`."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import ModelLoadError
from .model import Transformers
from .prefix_cache import parse_budget

__all__ = ["transformers"]


def transformers(model_name: str, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None, *,
                 prefix_cache: int | str | None = None, kv_budget: int | str | None = None, tp_plan: str | dict | None = None,
                 device_map: str | dict | None = None, **kwargs: Any) -> Transformers:
    """Load a causal LM and its tokenizer with ``from_pretrained`` and wrap them.

    Args:
        model_name: a hub id or a local folder.
        device: where to put the model (default: CPU). Not with ``tp_plan`` or ``device_map``.
        dtype: the weights' dtype (default: the checkpoint's).
        prefix_cache: byte budget of the automatic prefix cache (``"512MiB"``, ``"2GB"``, an int); off by default.
        kv_budget: the most KV cache bytes the calls running at once may reach (``"4GiB"``, an int), each counted at
            its longest (input plus ``max_tokens``): calls beyond it wait their turn (``run_batch`` of any size
            completes), a call that alone would exceed it is refused with ``KVCacheFullError``. Unbounded by default.
        tp_plan: tensor parallelism (``"auto"``, or a plan dict): every process launched by ``torchrun``
            holds a slice of every layer's heads (gloo on CPU, NCCL on GPU). Every rank runs the same
            continuum program (same prompts, seeds and calls); see ``docs/distributed.md``.
        device_map: layers spread over devices by accelerate (``"auto"``, or a dict module -> device);
            each layer's KV cache stays on that layer's device.
        **kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.

    Raises:
        ModelLoadError: the model cannot be loaded, or not with this parallel layout (``tp_plan``
            without ``torchrun``, heads not divisible by the number of processes, ``device`` with
            ``device_map``...); the message says how to launch or what to change.

    Example:
        >>> # torchrun --nproc-per-node 2 script.py, script.py holding:
        >>> model = models.transformers("meta-llama/Llama-3.2-1B", tp_plan="auto")   # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parse_budget(prefix_cache), parse_budget(kv_budget, "kv_budget")  # a bad budget fails before anything is loaded
    if tp_plan is not None or device_map is not None:
        kwargs.update(_parallel_kwargs(model_name, device, tp_plan, device_map, kwargs))
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name)
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype if dtype is not None else "auto", **kwargs)
    except OSError as exc:
        raise ModelLoadError(f"Could not load {model_name!r}: {exc}") from exc
    if device is not None:
        # PreTrainedModel.to is wrapped by functools.wraps, which mypy does not bind as a method (it wants `self`)
        model = model.to(device)  # type: ignore[arg-type]
    return Transformers(model, tokenizer, prefix_cache=prefix_cache, kv_budget=kv_budget)


def _parallel_kwargs(model_name: str, device: Any, tp_plan: Any, device_map: Any, kwargs: dict) -> dict:
    """The ``from_pretrained`` arguments for ``tp_plan`` / ``device_map``, after checking the layout can work
    (transformers would otherwise load a single-process model silently, or fail deep in a forward)."""
    if device is not None:
        raise ModelLoadError(f"device={device!r} with tp_plan/device_map: the plan places the weights itself; drop "
                             f"device= (device_map={{'': 'cuda:0'}} puts the whole model on one device)")
    if tp_plan is None:
        return {"device_map": device_map}
    if device_map is not None:
        raise ModelLoadError("tp_plan and device_map are exclusive: tensor parallelism splits every layer over the "
                             "processes of torchrun, device_map spreads whole layers over the devices of one process; "
                             "pick one")
    world = _world_size()
    if world is None:
        raise ModelLoadError(
            f"tp_plan={tp_plan!r} needs one process per device, started by torchrun, and none was: launch the script "
            f"with `torchrun --nproc-per-node N script.py` (or `python -m torch.distributed.run --nproc-per-node N "
            f"script.py`); every process runs the same program. In a single process, drop tp_plan (or use "
            f"device_map='auto' to spread layers over this process's devices).")
    _check_heads(model_name, world, kwargs)
    try:
        from transformers import DistributedConfig
    except ImportError:  # older transformers: the plan is passed directly
        return {"tp_plan": tp_plan}
    return {"distributed_config": DistributedConfig(tp_plan=tp_plan)}


def _world_size() -> int | None:
    """The number of processes of this torchrun launch, or None outside one (no process group, no ``WORLD_SIZE``)."""
    import os

    import torch.distributed as dist

    if not dist.is_available():
        return None
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None


def _check_heads(model_name: str, world: int, kwargs: dict) -> None:
    """Tensor parallelism gives every process ``heads / world`` query and key/value heads: both must divide."""
    from transformers import AutoConfig

    keep = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only", "trust_remote_code") if k in kwargs}
    try:
        cfg = AutoConfig.from_pretrained(model_name, **keep)
    except OSError as exc:
        raise ModelLoadError(f"Could not load {model_name!r}: {exc}") from exc
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        return
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % world == 0 and kv_heads % world == 0:
        return
    ok = [n for n in range(1, heads + 1) if heads % n == 0 and kv_heads % n == 0]
    raise ModelLoadError(
        f"{model_name!r} has {heads} attention heads and {kv_heads} key/value heads, which {world} processes cannot "
        f"share: tensor parallelism gives every process the same number of each. Launch with torchrun "
        f"--nproc-per-node in {ok}, or use device_map='auto' instead.")
