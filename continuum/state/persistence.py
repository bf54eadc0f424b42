"""Saving and loading states: tensors in safetensors, metadata (shape, tokenizer, last step) as JSON."""

from __future__ import annotations

import json

from ..errors import StateFileError
from .core import LastStep, SequenceState

__all__ = ["save", "load"]

_FORMAT_VERSION = 1


def _value_states(states):
    """Guide states that can be saved: outlines-core ints. Engine objects (llguidance matchers) are
    not saved; the loaded state then starts its constraint afresh instead of resuming it."""
    if states is None or not all(s is None or isinstance(s, int) for s in states):
        return None
    return states


def _guide_key(last: dict):
    if last.get("guide_key") is not None:
        return last["guide_key"]
    return "outlines:" + last["regex"] if last.get("regex") is not None else None  # files saved before guide keys


def save(state: SequenceState, path) -> None:
    """Save tokens, weights, log-probs and the KV cache (safetensors) with JSON metadata."""
    from safetensors.torch import save_file

    tensors = {"ids": state._ids, "mask": state._mask, "logprobs": state._logprobs, "weights": state._weights}
    for i, (k, v) in enumerate(state._kv or ()):
        tensors[f"k{i}"], tensors[f"v{i}"] = k, v
    last = None
    if state._last is not None:
        last = {"kind": state._last.kind, "starts": state._last.starts, "ends": state._last.ends,
                "complete": state._last.complete, "max_tokens": state._last.max_tokens,
                "guide_key": state._last.guide_key, "guide_states": _value_states(state._last.guide_states)}
    meta = {"format": _FORMAT_VERSION, "batch": state.batch, "samples": state.samples,
            "tokenizer": state._model.tokenizer.fingerprint, "tokenizer_name": state._model.tokenizer.name,
            "layers": len(state._kv or ()), "last": last}
    save_file({k: t.contiguous().cpu() for k, t in tensors.items()}, str(path), metadata={"continuum": json.dumps(meta)})

def load(path, model) -> SequenceState:
    """Load a state saved with :meth:`save` for ``model`` (which must use the same tokenizer)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["continuum"])
            tensors = {k: f.get_tensor(k).to(model.device) for k in f.keys()}
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise StateFileError(f"{path} is not a readable continuum state file: {exc}") from exc
    if meta.get("format") != _FORMAT_VERSION:
        raise StateFileError(f"{path}: unsupported state format {meta.get('format')!r}")
    if meta["tokenizer"] != model.tokenizer.fingerprint:
        raise StateFileError(f"{path} was saved with tokenizer {meta['tokenizer_name']!r} "
                             f"({meta['tokenizer']}); this model's tokenizer differs ({model.tokenizer.fingerprint})")
    try:
        kv = tuple((tensors[f"k{i}"], tensors[f"v{i}"]) for i in range(meta["layers"])) or None
        last = meta["last"]
        if last is not None:
            kind = last["kind"]
            last = LastStep(kind=kind, starts=tuple(last["starts"]), ends=tuple(last["ends"]),
                            complete=tuple(last["complete"]), parse=json.loads if kind == "json" else None,
                            max_tokens=last["max_tokens"], guide_key=_guide_key(last),
                            guide_states=tuple(last["guide_states"]) if last.get("guide_states") else None)
        return SequenceState(model=model, ids=tensors["ids"], mask=tensors["mask"], logprobs=tensors["logprobs"],
                   weights=tensors["weights"], kv=kv, batch=meta["batch"], samples=meta["samples"], last=last)
    except (KeyError, ValueError, TypeError) as exc:
        raise StateFileError(f"{path} is corrupt: {exc}") from exc
