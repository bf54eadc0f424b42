"""Will the rows of a generation fit in memory? Checked before a fork allocates them.

``samplers.multinomial(1000000)`` is a typo, not a request: on a CPU the kernel kills the process
(no exception) when the forked rows' logits and KV cache outgrow memory. :func:`check_rows_fit`
estimates what ``rows`` rows need over ``tokens`` positions (float32 log-probs over the vocabulary,
a few copies, plus the KV cache from the model's config) and raises
:class:`~continuum.errors.GeneratorArgumentError` when that is more than the memory available
(``MemAvailable`` on Linux, free memory on a CUDA device) over two; when either is unknown it says nothing.
"""

from __future__ import annotations

from typing import Any

from ..errors import GeneratorArgumentError

__all__ = ["check_rows_fit", "available_bytes", "row_bytes", "kv_bytes"]

# logits, log-probs, masked and sorted copies, the sampler's working tensors (measured peak: ~3x a 4-copy estimate)
_LOGIT_COPIES = 8
_HEADROOM = 2  # refuse past half the memory available: the estimate is rough and other allocations share it


def available_bytes(device) -> int | None:
    """Memory available for new tensors on ``device``, or None when unknown."""
    import torch

    try:
        if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
            return int(torch.cuda.mem_get_info(device)[0])
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError):
        return None
    return None


def row_bytes(model, tokens: int) -> int:
    """Bytes one row needs over ``tokens`` positions: its log-prob copies plus its KV cache."""
    cfg: Any = getattr(getattr(model, "model", None), "config", None)
    vocab = getattr(cfg, "vocab_size", None) or model.vocab_size
    return vocab * 4 * _LOGIT_COPIES + kv_bytes(model, tokens)


def kv_bytes(model, tokens: int) -> int:
    """Bytes of one row's KV cache over ``tokens`` positions: the backend's ``kv_bytes_per_token`` (0: it cannot
    tell)."""
    return tokens * int(model.kv_bytes_per_token or 0)


def config_kv_bytes_per_token(config: Any, itemsize: int) -> int:
    """Keys and values of every layer for one position, from a transformers config (0 for an unusual one)."""
    try:
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = cfg.num_hidden_layers
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return 2 * layers * kv_heads * head_dim * itemsize
    except (AttributeError, TypeError, ZeroDivisionError):
        return 0


def check_rows_fit(model, batch: int, samples: int, tokens: int, device) -> None:
    """Raise when ``batch * samples`` rows over ``tokens`` positions cannot fit in the memory available."""
    free = available_bytes(device)
    if free is None:
        return
    need = batch * samples * row_bytes(model, max(1, tokens))
    if need * _HEADROOM > free:
        raise GeneratorArgumentError(
            f"{batch} batch row(s) x {samples} samples/beams = {batch * samples} rows would need ~{need / 2**30:.3g} GiB "
            f"(log-probs over the vocabulary and the KV cache for up to {tokens} tokens), more than half of the "
            f"~{free / 2**30:.3g} GiB available: use fewer samples or beams, a smaller max_tokens, or fewer prompts per call")
