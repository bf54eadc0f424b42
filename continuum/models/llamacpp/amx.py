"""Whether llama.cpp's AMX kernels may run here, decided once per build and CPU in a child process.

On Intel CPUs with AMX (Sapphire Rapids and later), a llama.cpp built for the machine (``-march=native``) puts
quantized weights in its AMX buffer, and on some such machines its matmul segfaults at the first decode
(``ggml_backend_amx_mul_mat``, llama.cpp #20824: Gemma 3 270M Q4_K_M crashes, an f32 file takes no AMX kernel). A
segfault cannot be caught in-process, so where the CPU has AMX (``/proc/cpuinfo``: ``amx_*``; unknown elsewhere,
taken as none) *and* the build would use it (ggml's CPU device offers the "AMX" buffer type, or the system info says
``AMX_INT8 = 1``), :func:`decide` loads the very GGUF in a child Python (llama.cpp's default params, a 16-token
prefill and two one-token decodes, logits checked finite) before the real load. A child killed by a signal, or
hanging past the timeout (120 s + 1 s per 100 MB of file), means the path crashes; the load then goes around the AMX
buffers (``bufts.py``: the "repack" mode keeps CPU repacking, probed the same way; "plain" drops both) and a
``RuntimeWarning`` says so once per process, with the build flags that avoid the kernel; a crash in every mode is a
``ModelLoadError``, not a dead process. Verdicts are cached as JSON (``$XDG_CACHE_HOME/continuum/``, default
``~/.cache/continuum/llamacpp-amx.json``; deleting it re-probes), keyed by the llama-cpp-python version, its library
file, the system info, the CPU's AMX flags, the file's AMX-capable tensor types and the mode: one probe per build
and machine, not per load (a child that failed otherwise, e.g. on a corrupt file, is not cached: the real load says
why). A machine that crashes only sometimes (reported on #20824) can pass its one probe: set ``off`` there.

``CONTINUUM_LLAMACPP_AMX``: ``probe`` (the default), ``off`` (never load AMX buffers, no child: the "plain" mode),
``on`` (trust llama.cpp's default, no child).

Example:
    >>> decide("gemma-3-270m-q4_k_m.gguf", n_threads=4)     # doctest: +SKIP
    Decision(mode='default', reason='the CPU has no AMX')
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from ...errors import ModelLoadError
from ._lib import lib, version
from .bufts import AMX_TYPES, MODES, apply, cpu_features, extra_bufts, gguf_tensors, repack_patterns

__all__ = ["ENV", "Decision", "decide", "verdict", "probe", "cpu_amx_flags", "build_uses_amx", "cache_file", "guarded_llama"]

ENV = "CONTINUUM_LLAMACPP_AMX"
ISSUE = "llama.cpp #20824"
FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# verdicts that send the load around the mode probed, as the warning says them
UNSAFE = {"crashes": "crashed", "timeout": "hung (past the probe's timeout)", "bad-logits": "gave NaN/inf logits"}
_BAD_LOGITS = 3  # the child's exit status when a decode gave NaN/inf logits (wrong, if not a crash)
logger = logging.getLogger("continuum.llamacpp")
_warned = False  # the warning is said once per process


@dataclass(frozen=True)
class Decision:
    """How to load: ``mode`` one of ``bufts.MODES``, and why."""
    mode: str
    reason: str


def cpu_amx_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's AMX flags (``amx_tile``, ``amx_int8``, ``amx_bf16``...); empty where unknown (not Linux)."""
    if not sys.platform.startswith("linux"):
        return frozenset()
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(x for x in line.split(":", 1)[-1].split() if x.startswith("amx"))
    except OSError:
        pass
    return frozenset()


def build_uses_amx(system_info: str, bufts: dict[str, int]) -> bool:
    """True when this llama.cpp would put weights in AMX buffers: its CPU device lists the AMX buffer type (compiled
    in, and granted by the OS), or, where the list cannot be read, the system info says AMX_INT8 = 1."""
    return "AMX" in bufts if bufts else "AMX_INT8 = 1" in system_info


def cache_file() -> Path:
    """Where verdicts are kept: ``$XDG_CACHE_HOME/continuum/llamacpp-amx.json`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "continuum" / "llamacpp-amx.json"


def _read(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):  # missing, unreadable or corrupt: probed again and rewritten
        return {}
    return data if isinstance(data, dict) else {}


def _write(file: Path, key: str, entry: dict) -> None:
    """Add one verdict; atomic (a temporary file renamed over the old), so a reader never sees half a file."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        data = _read(file)  # (re-read: another process may have added verdicts meanwhile)
        data[key] = entry
        fd, tmp = tempfile.mkstemp(prefix=".llamacpp-amx.", dir=file.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, file)
    except OSError as exc:  # a read-only home only costs a probe per process
        logger.warning("could not cache llama.cpp's AMX verdict in %s: %s", file, exc)


def probe(path: str | os.PathLike, mode: str, n_threads: int, *, timeout: float,
          argv: list[str] | None = None) -> str:
    """Run the load-and-decode of :func:`_child` for ``mode`` in a child process: ``"ok"``, ``"crashes"`` (killed by
    a signal: SIGSEGV, SIGILL, abort), ``"timeout"`` (killed after ``timeout`` s), ``"bad-logits"``, or ``"error"``
    (it failed otherwise, e.g. llama.cpp refused the file: the real load will say why). ``argv`` replaces the child's
    command (tests); its arguments are appended: ``PATH MODE N_THREADS``."""
    root = str(Path(__file__).resolve().parents[3])  # the directory holding the continuum package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [*(argv or [sys.executable, "-c", f"import sys; from {__name__} import main; main(sys.argv[1:])"]),
           str(path), mode, str(n_threads)]
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    if done.returncode < 0:
        return "crashes"
    if done.returncode == _BAD_LOGITS:
        return "bad-logits"
    if done.returncode:
        logger.warning("llama.cpp AMX probe of %s (%s) failed with status %d: %s", Path(path).name, mode,
                       done.returncode, done.stderr.decode(errors="replace")[-2000:])
        return "error"
    return "ok"


def verdict(path: str | os.PathLike, mode: str, n_threads: int, key: str, *, timeout: float,
            argv: list[str] | None = None, file: Path | None = None) -> str:
    """:func:`probe`'s verdict for ``(key, mode)``, from the cache when it has one (an "error" is not cached)."""
    file = file or cache_file()
    entry = _read(file).get(f"{key}/{mode}")
    if isinstance(entry, dict) and entry.get("verdict") in ("ok", *UNSAFE):
        return str(entry["verdict"])
    logger.info("probing llama.cpp's AMX path (%s mode) on %s in a child process; cached in %s", mode,
                Path(path).name, file)
    found = probe(path, mode, n_threads, timeout=timeout, argv=argv)
    if found != "error":
        _write(file, f"{key}/{mode}", {"verdict": found, "file": Path(path).name, "llama_cpp": version(),
                                       "when": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return found


def _build_key(system_info: str, flags: frozenset[str], types: list[int]) -> str:
    so = str(getattr(getattr(lib(), "_lib", None), "_name", ""))  # the library file: a rebuild changes its stat
    stat = os.stat(so) if so and os.path.exists(so) else None
    ident = [version(), so, stat and (stat.st_size, stat.st_mtime_ns), system_info, sorted(flags), types]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:20]


def _warn(path: Path, mode: str, why: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    kept = "CPU repacking kept" if mode == "repack" else "and without CPU repacking"
    warnings.warn(f"{path.name}: {why}, so llama.cpp loads it without its AMX buffers ({kept}). This is {ISSUE}, a "
                  f"segfault in ggml_backend_amx_mul_mat on Sapphire Rapids-class CPUs. A llama.cpp built without AMX "
                  f'kernels avoids it: CFLAGS="{FLAGS}" CXXFLAGS="{FLAGS}" pip install --force-reinstall --no-cache-dir '
                  f"--no-binary llama-cpp-python llama-cpp-python (or CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON "
                  f'-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON", without -DGGML_AMX_INT8=ON). {ENV}=on skips this '
                  f"check, {ENV}=off always loads without AMX (docs/llamacpp.md)", RuntimeWarning, stacklevel=5)


def decide(path: str | os.PathLike, n_threads: int, *, timeout: float | None = None,
           argv: list[str] | None = None) -> Decision:
    """The load mode for ``path`` (see the module's docstring); a child process only where AMX could run, once.

    Raises:
        ModelLoadError: ``CONTINUUM_LLAMACPP_AMX`` has another value, or every mode crashed a child.
    """
    setting = os.environ.get(ENV, "probe").strip().lower() or "probe"
    if setting not in ("probe", "off", "on"):
        raise ModelLoadError(f"{ENV}={os.environ[ENV]!r}: use probe (the default), off or on")
    if setting == "on":
        return Decision("default", f"{ENV}=on")
    flags = cpu_amx_flags()
    if not flags:
        return Decision("default", "the CPU has no AMX")
    info = lib().llama_print_system_info().decode(errors="replace")
    if not build_uses_amx(info, extra_bufts()):
        return Decision("default", "this llama.cpp build has no AMX kernels")
    p = Path(path)
    try:
        tensors = gguf_tensors(p)
    except (OSError, ValueError, struct.error):
        tensors = []  # (unknown tensors: probe anyway)
    types = sorted({kind for _, _, kind in tensors} & AMX_TYPES)
    if tensors and not types:
        return Decision("default", "no tensor of this file takes an AMX kernel")
    if setting == "off":  # (the user's choice, said by no warning; unprobed, so the override-free "plain" mode)
        return Decision("plain", f"{ENV}=off")
    key, timeout = _build_key(info, flags, types), timeout or 120 + p.stat().st_size / 100e6
    modes = [m for m in MODES if m != "repack" or repack_patterns(tensors, cpu_features(info))]
    seen: dict[str, str] = {}
    for mode in modes:
        seen[mode] = found = verdict(p, mode, n_threads, key, timeout=timeout, argv=argv)
        if found in UNSAFE or (found == "error" and mode == "repack"):  # (overrides that do not load: try "plain")
            continue
        if mode != "default":
            _warn(p, mode, f"llama.cpp's AMX path {UNSAFE[seen['default']]} in a test process on this CPU")
        return Decision(mode, "probed: " + ", ".join(f"{m} {v}" for m, v in seen.items()))
    raise ModelLoadError(f"{p.name}: llama.cpp crashed a test process in every load mode ({', '.join(modes)}) on this "
                         f"machine; see {ISSUE}, and the verdicts in {cache_file()}")



def _child(args: list[str]) -> int:
    """The probe (``main([PATH, MODE, N_THREADS])`` in a child Python): load with ``mode``'s params, prefill 16
    tokens, decode 2 one at a time (the kernels of both), 0 when every logit is finite. A crash ends the process."""
    import ctypes

    import numpy as np

    path, mode, n_threads = args[0], args[1], int(args[2])
    L = lib()
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = 0
    keep = apply(mparams, mode, path)
    model = L.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        return 2
    cparams = L.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 64, 32, 32
    cparams.n_threads = cparams.n_threads_batch = n_threads
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        return 2
    n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))
    ids = [(1 + 7919 * i) % n_vocab for i in range(18)]
    for chunk in (ids[:16], ids[16:17], ids[17:]):
        tokens = (L.llama_token * len(chunk))(*chunk)
        if L.llama_decode(ctx, L.llama_batch_get_one(tokens, len(chunk))):
            return 2
        logits = np.ctypeslib.as_array(ctypes.cast(L.llama_get_logits_ith(ctx, -1), ctypes.POINTER(ctypes.c_float)),
                                       shape=(n_vocab,))
        if not np.isfinite(logits).all():
            return _BAD_LOGITS
    del keep
    return 0


_PATCH = threading.Lock()


def guarded_llama(path: str | os.PathLike, n_threads: int, **kwargs):
    """llama-cpp-python's own ``Llama`` on ``path``, loaded in the mode :func:`decide` gives continuum's loads (around
    llama.cpp's AMX path where it crashes here): the side-by-side reference of tests and benchmarks, which on a
    Sapphire Rapids-class CPU otherwise segfaults in ``ggml_backend_amx_mul_mat`` (Gemma 3 270M Q4_K_M, a 500-token
    prefill). ``Llama`` builds its model params inside its constructor, so their defaults are wrapped while it runs."""
    import llama_cpp
    from llama_cpp import llama_cpp as bindings

    mode, keep = decide(path, n_threads).mode, []
    default = bindings.llama_model_default_params

    def params():
        mparams = default()
        keep.append(apply(mparams, mode, path))  # (the override array llama.cpp reads through a pointer)
        return mparams

    with _PATCH:
        bindings.llama_model_default_params = params
        try:
            llm = llama_cpp.Llama(model_path=str(path), n_threads=n_threads, **kwargs)
        finally:
            bindings.llama_model_default_params = default
    llm._continuum_overrides = keep  # type: ignore[attr-defined]  # (kept alive with the model)
    return llm


def main(args: list[str]) -> None:
    """The probe child's entry point: exits with :func:`_child`'s status, skipping llama.cpp's teardown (only the
    verdict matters)."""
    os._exit(_child(args))
