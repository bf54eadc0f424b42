"""A pytest plugin that audits llama.cpp's cells before every decode (a debugging aid; never loaded by default).

Before each ``llama_decode`` of a sliding-window model's pool it copies every sequence of the batch into the pool's
probe id and reads its cells' positions from llama.cpp's own bytes (``seqbytes.positions``): each base cell below the
sequence's first new position and each window cell inside its window must be there, else the decode would run over
gaps and return wrong logits silently. A missing cell raises ``AssertionError("CELL AUDIT ...")`` at once, with the
decode's plan (each row's target, whether it is a fork, its source before planning); rows whose cells are missing
right after planning are logged as ``AFTER_PLAN``, failed decodes and ``make_room``'s answers too. This is how the window-8
GGUF's rare wrong log-prob was found (docs/benchmarks.md, twenty-first session). Use, from a copy of the repository:

    PYTHONPATH=tests CONTINUUM_CELL_AUDIT_LOG=/tmp/audit.log CONTINUUM_ORACLE=long \\
        python -m pytest -p cell_audit -x "tests/test_oracle.py::test_oracle[gguf-window]"

It costs two ``seq_cp`` and a state read per sequence and decode (several times slower).

``CONTINUUM_CELL_AUDIT_EVERY=1`` goes further (tens of times slower): after every cell operation (``seq_cp``,
``seq_rm``, a restore's ``set_data``, a decode) outside the probe id, every resident sequence not marked broken must
hold the window behind its own end, which no probe checks; a hole ``window.fits`` would miss (its lowest cell at or
below the window's start) is logged as ``SILENT`` with the operation after which it appeared and its stack, every
operation as ``OP`` with its callers, and each ``gaps.intact`` answer as ``INTACT``. This found the restore that
shared a broken relative's holes (docs/benchmarks.md, twenty-third session): the trip showed the hole, the log the
``seq_cp`` that brought it, and ``INTACT`` the probe that passed it.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import traceback
import weakref

import llama_cpp.llama_cpp as low
import numpy as np

from continuum.models.llamacpp import gaps, seqbytes, sequences

D = importlib.import_module("continuum.models.llamacpp.decode")  # (the package exports decode(), the function)
LOG = open(os.environ.get("CONTINUUM_CELL_AUDIT_LOG", os.devnull), "a")  # noqa: SIM115 - open while tests run
POOLS: dict[int | None, weakref.ref] = {}  # by context, and by memory (the memory ops' first argument)
EVERY = os.environ.get("CONTINUUM_CELL_AUDIT_EVERY") == "1"
ORIG = {name: getattr(low, name) for name in ("llama_memory_seq_cp", "llama_memory_seq_rm", "llama_state_seq_set_data")}
SEEN: dict[int, dict] = {}


def _log(text: str) -> None:
    LOG.write(text + "\n")
    LOG.flush()


def missing(pool, seq_id: int, p: int) -> tuple[list[int], list[int]]:
    """Positions below ``p`` sequence ``seq_id`` lacks: base cells, then window cells inside the window behind ``p``."""
    if p == 0:
        return [], []
    mem, model = pool.model.memory, pool.model
    ORIG["llama_memory_seq_rm"](mem, pool.probe, -1, -1)  # (the originals: the audited ones would audit this)
    ORIG["llama_memory_seq_cp"](mem, seq_id, pool.probe, 0, p)
    blob = seqbytes.get(model, pool.probe)
    ORIG["llama_memory_seq_rm"](mem, pool.probe, -1, -1)
    held = seqbytes.positions(blob)
    if held is None:
        return [], []
    base = np.setdiff1d(np.arange(p), held[0]).tolist()
    swa = np.setdiff1d(np.arange(max(0, p - model.n_swa + 1), p), held[1]).tolist() if len(held) > 1 else []
    return base, swa


def _desc(seq) -> str:
    if seq is None:
        return "None"
    return (f"Seq(id={seq.id}, extent={seq.extent}, longest={seq.longest}, holders={dict(seq.holders)}, "
            f"broken={seq.broken}, spilled={seq.blob is not None})")


_init = sequences.SequencePool.__init__


def _pool_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    POOLS[ctypes.cast(self.model.ctx, ctypes.c_void_p).value] = weakref.ref(self)
    POOLS[ctypes.cast(self.model.memory, ctypes.c_void_p).value] = weakref.ref(self)


_decode = low.llama_decode
_plan_of_decode: list = []


def _audited_decode(ctx, batch):
    ref = POOLS.get(ctypes.cast(ctx, ctypes.c_void_p).value)
    pool = ref() if ref is not None else None
    if pool is not None and pool.probe is not None and batch.seq_id:
        first: dict[int, int] = {}
        for i in range(batch.n_tokens):
            for j in range(batch.n_seq_id[i]):
                s = batch.seq_id[i][j]
                if s != pool.scratch:
                    first[s] = min(first.get(s, 1 << 30), batch.pos[i])
        for s, p in first.items():
            base, swa = missing(pool, s, p)
            if base or swa:
                msg = (f"CELL AUDIT: seq {s} at pos {p} misses base {base} window {swa} (batch of {batch.n_tokens}; "
                       f"plan {_plan_of_decode[-1] if _plan_of_decode else None})")
                _log(msg + "\n" + "".join(traceback.format_stack(limit=30)))
                raise AssertionError(msg)
    rc = _decode(ctx, batch)
    if rc != 0:
        _log(f"DECODE rc {rc} of {batch.n_tokens} tokens")
    if EVERY and pool is not None and pool.probe is not None:
        _every(pool, f"llama_decode of {batch.n_tokens} tokens -> {rc}")
    return rc


def _silent(pool) -> dict:
    """Resident sequences not marked broken whose window behind their own end has holes ``window.fits`` misses."""
    mem, out = pool.model.memory, {}
    for sid, seq in list(pool.resident.items()):
        hi = int(low.llama_memory_seq_pos_max(mem, sid)) if sid is not None and not seq.broken else -1
        if hi < 0:
            continue
        holes = missing(pool, sid, hi + 1)[1]
        if holes and int(low.llama_memory_seq_pos_min(mem, sid)) <= max(0, hi + 1 - pool.model.n_swa + 1):
            out[sid] = (hi + 1, tuple(holes))
    return out


def _every(pool, after: str) -> None:
    now, before = _silent(pool), SEEN.get(id(pool), {})
    SEEN[id(pool)] = now
    new = {k: v for k, v in now.items() if before.get(k) != v}
    if new:
        _log(f"SILENT after {after}: " + "; ".join(
            f"seq {k} at its end {e} misses window {list(h)} [{_desc(pool.resident.get(k))}]" for k, (e, h) in new.items())
             + "\n" + "".join(traceback.format_stack()[-16:-2]))


def _audited_op(name: str):
    orig = ORIG[name]

    def op(*args):
        rc = orig(*args)
        ref = POOLS.get(ctypes.cast(args[0], ctypes.c_void_p).value)
        pool = ref() if ref is not None else None
        if pool is not None and pool.probe is not None and pool.probe not in args[1:3]:  # (not the probes' own)
            callers = traceback.extract_stack(limit=4)[:-1]
            _log(f"OP {name[6:]}{tuple(a for a in args[1:] if isinstance(a, int))} -> {rc} @ "
                 + " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}:{f.name}" for f in reversed(callers)))
            _every(pool, f"{name}{tuple(a for a in args[1:] if isinstance(a, int))}")
        return rc
    return op


def _audited_intact(pool, seq_id, lo, hi, end):
    ok = _intact(pool, seq_id, lo, hi, end)
    _log(f"INTACT seq {seq_id} [{lo}, {hi}) end {end} -> {ok}; holes below {hi}: {missing(pool, seq_id, hi)[1]}")
    return ok


_intact = gaps.intact


_plan = D._plan


def _audited_plan(pool, rows):
    sources = [(_desc(r.view.seq), r.view.n_tokens, len(r.tokens)) for r in rows]
    targets, forks = _plan(pool, rows)
    plan = [(i, _desc(t), r.view.n_tokens, any(t is f for f in forks), sources[i])
            for i, (r, t) in enumerate(zip(rows, targets)) if t is not None]
    _plan_of_decode[:] = [plan]
    for i, (r, t) in enumerate(zip(rows, targets)):
        if pool.probe is not None and t is not None and t.id is not None:
            base, swa = missing(pool, t.id, r.view.n_tokens)
            if base or swa:
                _log(f"AFTER_PLAN: row {i} target {_desc(t)} view of {r.view.n_tokens} misses {base} {swa}")
    return targets, forks


_make_room = D.cells.make_room


def _audited_room(pool, cells, pinned=(), spare=()):
    ok = _make_room(pool, cells, pinned, spare)
    _log(f"ROOM for {cells}: {ok}")
    return ok


def pytest_configure(config):  # (patched when the plugin is loaded: -p cell_audit)
    sequences.SequencePool.__init__ = _pool_init
    low.llama_decode = _audited_decode
    D._plan = _audited_plan
    D.cells.make_room = _audited_room
    if EVERY:
        for name in ORIG:
            setattr(low, name, _audited_op(name))
        gaps.intact = _audited_intact
