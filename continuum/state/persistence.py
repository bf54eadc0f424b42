"""Saving and loading states: tensors in safetensors, metadata (shape, tokenizer, model, last step) as JSON.

A file records the identity of the model that computed its KV cache (architecture, config hash,
weights fingerprint, parallel layout: see ``continuum.models.identity``). Loading it into a model with another
identity (same tokenizer) keeps the tokens, weights, log-probs and last step but DROPS the cache,
with a warning on the ``"continuum"`` logger: the next generator recomputes it in one pass. Files
of format 1 (before model identities were recorded) are treated as coming from an unknown model.
Under tensor parallelism each rank saves its own file (its cache holds its heads only): it loads with
its cache into the same rank of the same layout; anywhere else (another rank, another world size, a
single process) the cache is dropped with the same warning and recomputed (files saved before layouts
were recorded count as single-process).

A llama.cpp state's KV is written by its backend (``model.save_kv``: each distinct sequence's bytes once, behind the
GGUF's fingerprint, :mod:`continuum.models.llamacpp.persist`) and restored into fresh sequences by a model with the
same fingerprint (``model.load_kv``); from another model, or damaged, it is dropped with the same warning. A file
also records what its ids mean (``ids_fingerprint``), so a state saved on one backend loads (recomputed) on another
whose ids mean the same.
"""

from __future__ import annotations

import contextlib
import json
import logging

from ..errors import BackendError, StaleWindowError, StateFileError
from ..models import kv as kvcache
from ..models.identity import ModelFingerprint
from .convert import uncached
from .core import LastStep, SequenceState

__all__ = ["foreign", "last_step", "load", "metadata", "read", "save", "write"]

logger = logging.getLogger("continuum")

_FORMAT_VERSION = 2  # 2: records the model's identity
_READABLE = (1, 2)


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


def metadata(state: SequenceState) -> dict:
    """The JSON metadata of a state file: shape, tokenizer, model identity, last step."""
    last = None
    if state._last is not None:
        last = {"kind": state._last.kind, "starts": state._last.starts, "ends": state._last.ends,
                "complete": state._last.complete, "max_tokens": state._last.max_tokens,
                "guide_key": state._last.guide_key, "guide_states": _value_states(state._last.guide_states),
                "finish": state._last.finish, "marks": state._last.marks, "thoughts": state._last.thoughts}
    return {"format": _FORMAT_VERSION, "batch": state.batch, "samples": state.samples,
            "tokenizer": state._model.tokenizer.fingerprint, "tokenizer_name": state._model.tokenizer.name,
            "ids": getattr(state._model.tokenizer, "ids_fingerprint", None),
            "model": state._model.fingerprint.as_dict(), "layers": len(_tensor_kv(state) or ()), "last": last}


def _tensor_kv(state: SequenceState):
    """The KV tensors a state file holds: a transformers cache's (another backend's KV is written by the backend,
    ``model.save_kv``, or not at all: the loaded state recomputes it in one pass when continued)."""
    return kvcache.tensors(state._kv)


# safetensors' names of the dtypes a state file holds (anything else is written by safetensors itself)
_DTYPES = {"torch.float64": "F64", "torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
           "torch.int64": "I64", "torch.int32": "I32", "torch.int16": "I16", "torch.int8": "I8", "torch.uint8": "U8",
           "torch.bool": "BOOL"}


def _layout(tensors: dict, meta: dict) -> tuple[bytes, list] | None:
    """The safetensors file of ``tensors`` as its header (length and JSON) and the tensors' bytes in order, laid out
    as safetensors lays them out (widest elements first, then by name: every tensor aligned); None when a tensor's
    dtype is not one of :data:`_DTYPES`. Written directly: ``safetensors.torch.save_file`` spends ~0.4 ms per small
    file in Python around the copy (a remote call's part, B30)."""
    import torch

    items = []
    for name, t in tensors.items():
        code = _DTYPES.get(str(t.dtype))
        if code is None:
            return None
        items.append((name, code, t.detach().contiguous().cpu()))
    items.sort(key=lambda item: (-item[2].element_size(), item[0]))
    header: dict = {"__metadata__": {"continuum": json.dumps(meta)}}
    offset, data = 0, []
    for name, code, t in items:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
        if size:
            data.append(t.reshape(-1).view(torch.uint8).numpy())
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # (the data starts 8-byte aligned, as safetensors pads it)
    return len(text).to_bytes(8, "little") + text, data


def write(path, tensors: dict, meta: dict) -> None:
    """``tensors`` (CPU, contiguous) and ``meta`` (under the ``"continuum"`` key) to a safetensors file.

    Written beside ``path`` and moved onto it: a state loaded from ``path`` earlier may still read its tensors from
    the file's mapping (safetensors loads without copying), and writing the same file in place truncated what that
    mapping shows (a bus error at the old state's next read; the oracle saved and loaded through one path). A crash
    mid-write also leaves the old file whole."""
    import os
    import threading

    laid = _layout(tensors, meta)
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"  # (beside it: the move stays on one file system)
    try:
        if laid is None:
            from safetensors.torch import save_file

            save_file({k: t.contiguous().cpu() for k, t in tensors.items()}, tmp, metadata={"continuum": json.dumps(meta)})
        else:
            head, data = laid
            with open(tmp, "wb") as f:
                f.write(head)
                for chunk in data:
                    f.write(chunk)
        os.replace(tmp, str(path))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save(state: SequenceState, path) -> None:
    """Save tokens, weights, log-probs and the KV cache (safetensors) with JSON metadata,
    including the identity of the model that computed the cache (``model.fingerprint``)."""
    tensors = {"ids": state._ids, "mask": state._mask, "logprobs": state._logprobs, "weights": state._weights}
    for i, (k, v) in enumerate(_tensor_kv(state) or ()):
        tensors[f"k{i}"], tensors[f"v{i}"] = k, v
    meta = metadata(state)
    saver = getattr(state._model, "save_kv", None)
    if kvcache.opaque(state._kv) and saver is not None:  # another backend's KV: its own format
        try:
            handle_tensors, meta["kv_handle"] = saver(state._kv)
            tensors.update(handle_tensors)
        except StaleWindowError:  # (llama.cpp gave a sliding window's cells away: loaded, the tokens are computed again)
            pass
    write(path, tensors, meta)


def encode(tensors: dict, meta: dict) -> bytes:
    """What :func:`write` writes, as bytes (a database stores them: ``serve/pgstore.py``)."""
    laid = _layout(tensors, meta)
    if laid is None:
        from safetensors.torch import save

        return save({k: t.contiguous().cpu() for k, t in tensors.items()}, metadata={"continuum": json.dumps(meta)})
    head, data = laid
    return b"".join([head, *data])  # (the arrays are C-contiguous buffers: one copy)


def _decode(data: bytes | bytearray | memoryview) -> tuple[dict, dict]:
    from safetensors.torch import load

    # the format's header: 8 bytes of little-endian length, then JSON whose "__metadata__" holds ours
    size = int.from_bytes(data[:8], "little")
    meta = json.loads(json.loads(bytes(data[8:8 + size]))["__metadata__"]["continuum"])
    return meta, load(bytes(data))


def read(path, model) -> tuple[dict, dict]:
    """A state file's (or its bytes': :func:`encode`) metadata and tensors (on ``model``'s device), checked:
    readable, a known format, ``model``'s tokenizer. Raises ``FileNotFoundError`` or :class:`StateFileError`."""
    from safetensors import safe_open

    try:
        if isinstance(path, (bytes, bytearray, memoryview)):
            meta, tensors = _decode(path)
            tensors = {k: t.to(model.device) for k, t in tensors.items()}
            path = "a stored state part"  # (for the messages below)
        else:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {})["continuum"])
                tensors = {k: f.get_tensor(k).to(model.device) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise StateFileError(f"{path} is not a readable continuum state file ({exc}): it was not written by "
                             f"SequenceState.save or is damaged; save the state again") from exc
    if meta.get("format") not in _READABLE:
        raise StateFileError(f"{path}: unsupported state format {meta.get('format')!r} (this version reads {_READABLE})")
    ids = getattr(model.tokenizer, "ids_fingerprint", None)
    if meta["tokenizer"] != model.tokenizer.fingerprint and (meta.get("ids") is None or meta.get("ids") != ids):
        raise StateFileError(f"{path} was saved with tokenizer {meta['tokenizer_name']!r} "
                             f"({meta['tokenizer']}); this model's tokenizer differs ({model.tokenizer.fingerprint})")
    return meta, tensors


def foreign(meta: dict, model, path) -> bool:
    """Whether the file's cache was computed by another model than ``model`` (then it is dropped, with a warning)."""
    saved, mine = meta.get("model"), model.fingerprint
    try:  # the saved identity in the model's own kind (another backend's does not fit it: foreign)
        saved = (ModelFingerprint.from_dict(saved) if isinstance(mine, ModelFingerprint) else type(mine)(**saved)) \
            if isinstance(saved, dict) else None
    except TypeError:
        pass
    if saved == mine:
        return False
    if isinstance(saved, ModelFingerprint):
        origin = f"model {saved.architecture} (config {saved.config}, weights {saved.weights}, {saved.layout})"
    else:
        origin = f"model {saved}" if saved is not None else "an unknown model (a file without a model identity)"
    logger.warning("%s was saved from %s, not this model (%s): its KV cache is dropped; tokens, weights, "
                   "log-probs and the last step are kept, and the next generator recomputes the cache in one "
                   "pass.", path, origin, model.fingerprint)
    return True


def last_step(last: dict | None) -> LastStep | None:
    """The :class:`LastStep` of a file's metadata."""
    if last is None:
        return None
    kind = last["kind"]
    return LastStep(kind=kind, starts=tuple(last["starts"]), ends=tuple(last["ends"]),
                    complete=tuple(last["complete"]), parse=json.loads if kind == "json" else None,
                    max_tokens=last["max_tokens"], guide_key=_guide_key(last),
                    guide_states=tuple(last["guide_states"]) if last.get("guide_states") else None,
                    finish=tuple(last["finish"]) if last.get("finish") else None,
                    marks=tuple(tuple(tuple(m) for m in row) for row in last["marks"]) if last.get("marks") else None,
                    thoughts=tuple(tuple(t) for t in last["thoughts"]) if last.get("thoughts") else None)


def _handle_kv(meta: dict, tensors: dict, model, path):
    """A backend's own KV from the file (``model.load_kv``), or None with a warning (another model, damaged bytes,
    refused by the backend): the state is then recomputed in one pass."""
    loader = getattr(model, "load_kv", None)
    if loader is None or foreign(meta, model, path):
        if loader is None:
            logger.warning("%s holds a KV of another backend (%s), not usable by %r: it is dropped and the next "
                           "generator recomputes it in one pass.", path, meta["kv_handle"].get("backend"), model)
        return None
    try:
        return loader({k: t.cpu() for k, t in tensors.items()}, meta["kv_handle"])
    except (StateFileError, BackendError) as exc:  # ForeignStateError is a StateFileError
        logger.warning("%s: its KV cannot be restored (%s): it is dropped; tokens, weights, log-probs and the last "
                       "step are kept, and the next generator recomputes the cache in one pass.", path, exc)
        return None


def load(path, model) -> SequenceState:
    """Load a state saved with :meth:`save` for ``model`` (which must use the same tokenizer).

    Saved from another model (or by format 1, which recorded no model), the state keeps its tokens,
    weights, log-probs and last step but drops the KV cache, with a warning on the ``"continuum"`` logger.
    """
    meta, tensors = read(path, model)
    try:
        layers = tuple((tensors[f"k{i}"], tensors[f"v{i}"]) for i in range(meta["layers"])) or None
        dropped = layers is not None and foreign(meta, model, path)
        kv = None if dropped else kvcache.from_tensors(model, layers)
        if meta.get("kv_handle") is not None:
            kv = _handle_kv(meta, tensors, model, path)
            dropped = kv is None
        state = SequenceState(model=model, ids=tensors["ids"], mask=tensors["mask"], logprobs=tensors["logprobs"],
                              weights=tensors["weights"], kv=kv, batch=meta["batch"], samples=meta["samples"],
                              last=last_step(meta["last"]))
        return uncached(state, model) if dropped else state
    except (KeyError, ValueError, TypeError) as exc:
        raise StateFileError(f"{path} is corrupt ({exc}): save the state again") from exc
