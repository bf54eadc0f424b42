"""A stored state's backend KV across a graceful restart: written beside its part at shutdown, read once at the next start.

A part holds the KV as columns of tensors where it can be cut (transformers), and tokens only where the backend
keeps the KV itself (llama.cpp's sequences, a hybrid's recurrent snapshots): a turn cannot write just its new
columns of those. So a GGUF server's states, once the process ends, used to come back as tokens, and each
conversation's first call after a restart computed its whole history again. At shutdown (``Store.save_resident``,
from ``Context.close``) every state in the store's memory whose KV is the backend's own is saved whole, the
continuum state file format with the backend's fingerprinted KV (``SequenceState.save``), as ``<part>.kv`` beside
its part; the next process loading that response (``Store.state``) restores it from there, its KV included, and
removes the file (the state is in memory again, and a later shutdown writes it anew). A ``kill -9`` writes
nothing: those states come back as tokens, as before. A sidecar from another model or llama.cpp build is refused
by its fingerprint and the state is loaded from its parts instead; a sidecar goes with its part (delete,
retention, orphans at start). Sidecars are not counted in ``--store-max-bytes``: they hold at most what was in
memory at the last shutdown (``--state-memory``), and the next start consumes them.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from ..errors import ContinuumError
from ..models import kv as kvcache
from ..state import SequenceState

__all__ = ["SUFFIX", "load", "part_of", "path", "save_all"]

SUFFIX = ".kv"
logger = logging.getLogger("continuum")


def path(states_dir: Path, file: str) -> Path:
    """Where the sidecar of part ``file`` lives."""
    return states_dir / (file + SUFFIX)


def part_of(name: str) -> str | None:
    """The part a file name is the sidecar of, or None."""
    return name[: -len(SUFFIX)] if name.endswith(SUFFIX) else None


def save_all(states_dir: Path, resident: list[tuple[str, SequenceState]]) -> int:
    """Save each ``(part file, state)`` whose KV is the backend's own; returns how many were written. A state that
    cannot be saved is skipped with a warning (a shutdown never fails on it: the state comes back as tokens)."""
    written = 0
    for file, state in resident:
        if not kvcache.opaque(state._kv):
            continue  # (its parts hold its KV already, or it has none)
        target = path(states_dir, file)
        if target.exists():
            continue  # (already saved: parts and their states never change)
        try:
            state.save(target)
            written += 1
        except Exception as exc:  # noqa: BLE001 - any failure leaves the state to its parts' tokens
            logger.warning("continuum serve: the KV of stored state %s was not saved at shutdown (%s: %s); it is "
                           "computed again from its tokens when next used", file, type(exc).__name__, exc)
            with contextlib.suppress(OSError):
                target.unlink()
    return written


def load(states_dir: Path, file: str, model: Any) -> SequenceState | None:
    """The state saved beside part ``file`` with its KV, or None (none saved, or not usable here: then the parts are
    read); the sidecar is removed either way once read."""
    target = path(states_dir, file)
    if not target.exists():
        return None
    try:
        state = SequenceState.load(target, model)
    except FileNotFoundError:
        return None  # (another request for the same response read it first: it is in memory, or its parts are read)
    except (ContinuumError, OSError) as exc:
        logger.warning("continuum serve: the saved KV of stored state %s was not loaded (%s: %s); its tokens are "
                       "read from its parts", file, type(exc).__name__, exc)
        state = None
    with contextlib.suppress(OSError):
        target.unlink()
    if state is not None and state._kv is None:
        return None  # (the KV was refused, by fingerprint or damage: the parts are the record)
    return state
