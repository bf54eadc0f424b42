"""The AMX guard (``continuum/models/llamacpp/amx.py``, ``bufts.py``): llama.cpp's AMX matmul segfaults on some
Sapphire Rapids-class machines (llama.cpp #20824), so where it could run it is probed once in a child process and
the load goes around it when the child dies.

The probe is driven by real children (one that kills itself with SIGSEGV, one that hangs, one that succeeds, the
real load-and-decode on real GGUFs); the detection of an AMX machine is patched where this CPU has none. The "repack"
load mode (no AMX buffers, repacking kept through tensor buffer-type overrides) is checked against llama.cpp itself:
the same tensors in CPU_REPACK as llama.cpp's default on a CPU without AMX kernels (its log), and the same logits.
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
import time
import warnings
from collections import Counter

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from continuum.errors import ModelLoadError
from continuum.models.llamacpp import LlamaCppModel, amx, bufts
from continuum.models.llamacpp._lib import lib, mark_decoded

from llamacpp_support import gemma_path, gguf

PY = sys.executable
# this machine runs llama.cpp's AMX kernels for real (an AMX CPU and a build with them), where #20824 may crash the
# default mode (seen on the eighteenth session's Xeon: the Gemma probe's default child died with SIGSEGV)
REAL_AMX = bool(amx.cpu_amx_flags()) and amx.build_uses_amx(lib().llama_print_system_info().decode(), bufts.extra_bufts())
SEGV = [PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
OK = [PY, "-c", "pass"]


def counting(counter, crash_modes=()) -> list[str]:
    """A child that records its run in ``counter`` (one line: its mode) and segfaults for the modes given."""
    code = (f"import os, signal, sys; mode = sys.argv[2]; open({str(counter)!r}, 'a').write(mode + ' ');"
            f"os.kill(os.getpid(), signal.SIGSEGV) if mode in {tuple(crash_modes)!r} else None")
    return [PY, "-c", code]


def runs(counter) -> list[str]:
    return counter.read_text().split() if counter.exists() else []


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh verdict cache (XDG_CACHE_HOME), the probe setting unset, and the once-per-process warning re-armed."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(amx.ENV, raising=False)
    monkeypatch.setattr(amx, "_warned", False)
    return tmp_path / "xdg" / "continuum" / "llamacpp-amx.json"


@pytest.fixture
def amx_machine(monkeypatch):
    """This process sees an AMX CPU and a build that would use it (this machine may have neither)."""
    monkeypatch.setattr(amx, "cpu_amx_flags", lambda: frozenset({"amx_tile", "amx_int8", "amx_bf16"}))
    monkeypatch.setattr(amx, "build_uses_amx", lambda info, found: True)


# -- detection -------------------------------------------------------------------------------------------------
def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8 avx512_fp16\n")
    assert amx.cpu_amx_flags(str(info)) == {"amx_bf16", "amx_tile", "amx_int8"}
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert amx.cpu_amx_flags(str(info)) == frozenset()
    assert amx.cpu_amx_flags(str(tmp_path / "missing")) == frozenset()


def test_build_detection_reads_the_cpu_devices_buffer_types():
    assert amx.build_uses_amx("", {"AMX": 1, "CPU_REPACK": 2})
    assert not amx.build_uses_amx("AMX_INT8 = 1 |", {"CPU_REPACK": 2})  # (the device's list wins: the OS may refuse)
    assert amx.build_uses_amx("CPU : AVX2 = 1 | AMX_INT8 = 1 |", {})
    assert not amx.build_uses_amx("CPU : AVX2 = 1 |", {})
    # this build, through ggml's registry: the repack buffer type is there; AMX exactly where its system info says
    found, info = bufts.extra_bufts(), lib().llama_print_system_info().decode()
    assert "CPU_REPACK" in found and all(isinstance(p, int) and p for p in found.values())
    assert ("AMX" in found) == ("AMX_INT8 = 1" in info)


def test_gguf_header_reader_matches_the_gguf_package():
    gguf_pkg = pytest.importorskip("gguf")
    for kind in ("f32", "q8_0"):  # (gguf's reader takes ~15 s over Gemma's 262k-token vocabulary: the fixtures here)
        path = gguf(kind)
        theirs = [(t.name, tuple(int(s) for s in t.shape), int(t.tensor_type)) for t in gguf_pkg.GGUFReader(path).tensors]
        assert bufts.gguf_tensors(path) == theirs and len(theirs) > 10
    tensors = bufts.gguf_tensors(gemma_path())  # the types the research note read with gguf: 109 F32, 81 Q5_0...
    assert Counter(kind for _, _, kind in tensors) == {0: 109, 6: 81, 12: 27, 8: 10, 14: 9}
    assert ("token_embd.weight", (640, 262144), 8) in tensors
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        bufts.gguf_tensors(__file__)


def test_repack_patterns_follow_the_x86_repacker():
    """Only 2-D matmul weights of a type the x86 repacker takes, rows in groups of 8 (a tensor put in CPU_REPACK
    without a repack layout crashes llama.cpp's load), grouped by kind."""
    q4_0, q4_k, q2_k, q6_k, q8_0 = 2, 12, 10, 14, 8
    tensors = [("blk.0.attn_q.weight", (640, 1024), q4_k), ("blk.3.attn_q.weight", (640, 1024), q4_k),
               ("blk.1.attn_q.weight", (640, 1024), q6_k),  # Q6_K: repacked on ARM only
               ("blk.0.ffn_down.weight", (2048, 640), q4_0), ("blk.1.ffn_down.weight", (2048, 644), q4_0),  # 644 % 8
               ("blk.0.ffn_up.weight", (640, 2048), q2_k),  # Q2_K: AVX512 only
               ("blk.0.ffn_up_exps.weight", (640, 2048, 8), q4_k),  # 3-D experts: left alone
               ("token_embd.weight", (640, 262144), q4_0),  # get_rows, not a matmul
               ("blk.0.attn_norm.weight", (640,), 0), ("output.weight", (640, 262144), q4_k),
               ("blk.0.attn_v.weight", (640, 256), q8_0)]  # Q8_0: repacked on ARM only
    assert bufts.repack_patterns(tensors, frozenset({"AVX2"})) == [
        r"^blk\.(0|3)\.attn_q\.weight$", r"^blk\.(0)\.ffn_down\.weight$", r"^output\.weight$"]
    assert r"^blk\.(0)\.ffn_up\.weight$" in bufts.repack_patterns(tensors, frozenset({"AVX2", "AVX512"}))
    assert bufts.repack_patterns(tensors, frozenset({"SSE3"})) == []


def test_an_f32_file_takes_no_amx_kernel_and_is_never_probed(cache, amx_machine, tmp_path):
    counter = tmp_path / "runs"
    decision = amx.decide(gguf("f32"), 1, argv=counting(counter))
    assert decision == amx.Decision("default", "no tensor of this file takes an AMX kernel") and runs(counter) == []


def test_no_amx_cpu_means_no_probe(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(amx, "cpu_amx_flags", lambda: frozenset())
    counter = tmp_path / "runs"
    assert amx.decide(gemma_path(), 1, argv=counting(counter)).mode == "default" and runs(counter) == []


# -- the probe -------------------------------------------------------------------------------------------------
def test_probe_verdicts_from_real_children(tmp_path):
    path = gguf("f32")
    assert amx.probe(path, "default", 1, timeout=30, argv=SEGV) == "crashes"
    assert amx.probe(path, "default", 1, timeout=30, argv=[PY, "-c", "import os; os.abort()"]) == "crashes"
    assert amx.probe(path, "default", 1, timeout=30, argv=OK) == "ok"
    assert amx.probe(path, "default", 1, timeout=30, argv=[PY, "-c", "raise SystemExit(3)"]) == "bad-logits"
    assert amx.probe(path, "default", 1, timeout=30, argv=[PY, "-c", "raise SystemExit(1)"]) == "error"
    start = time.monotonic()
    assert amx.probe(path, "default", 1, timeout=1, argv=[PY, "-c", "import time; time.sleep(60)"]) == "timeout"
    assert time.monotonic() - start < 20  # killed, not waited for


@pytest.mark.parametrize("mode", bufts.MODES)
def test_the_real_child_loads_and_decodes_gemma(mode):
    """The probe's own program (no argv): llama.cpp's load in each mode and a prefill + two decodes survive here; the
    default mode may crash where the AMX kernels really run (#20824: the verdict the guard exists for)."""
    verdict = amx.probe(gemma_path(), mode, 2, timeout=120)
    assert verdict == "ok" or (mode == "default" and REAL_AMX and verdict in amx.UNSAFE), verdict


def test_the_real_child_reports_a_file_llama_cpp_refuses(tmp_path):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(gemma_path().read_bytes()[:4096])
    assert amx.probe(bad, "default", 1, timeout=60) == "error"


# -- the verdict cache -----------------------------------------------------------------------------------------
def test_a_verdict_is_probed_once_per_key_and_kept_on_disk(cache, tmp_path):
    counter, path = tmp_path / "runs", gguf("f32")
    assert amx.cache_file() == cache
    assert amx.verdict(path, "default", 1, "build-a", timeout=30, argv=counting(counter, ["default"])) == "crashes"
    assert amx.verdict(path, "default", 1, "build-a", timeout=30, argv=counting(counter)) == "crashes"  # cached
    assert runs(counter) == ["default"]
    assert amx.verdict(path, "default", 1, "build-b", timeout=30, argv=counting(counter)) == "ok"  # another build
    assert amx.verdict(path, "repack", 1, "build-a", timeout=30, argv=counting(counter)) == "ok"  # another mode
    assert runs(counter) == ["default", "default", "repack"]
    data = json.loads(cache.read_text())
    assert {k: v["verdict"] for k, v in data.items()} == {"build-a/default": "crashes", "build-b/default": "ok",
                                                            "build-a/repack": "ok"}
    assert sorted(p.name for p in cache.parent.iterdir()) == ["llamacpp-amx.json"]  # (no temporary file left)


def test_a_corrupt_cache_is_probed_again_and_rewritten(cache, tmp_path):
    counter, path = tmp_path / "runs", gguf("f32")
    cache.parent.mkdir(parents=True)
    for corrupt in ("{not json", "[1, 2]", json.dumps({"k/default": "crashes"})):
        cache.write_text(corrupt)
        assert amx.verdict(path, "default", 1, "k", timeout=30, argv=counting(counter)) == "ok"
        assert json.loads(cache.read_text())["k/default"]["verdict"] == "ok"
    assert runs(counter) == ["default"] * 3


def test_a_child_that_failed_otherwise_is_not_cached(cache, tmp_path):
    path = gguf("f32")
    assert amx.verdict(path, "default", 1, "k", timeout=30, argv=[PY, "-c", "raise SystemExit(1)"]) == "error"
    assert not cache.exists()


# -- the decision --------------------------------------------------------------------------------------------
def test_a_crashing_default_loads_with_repacking_and_warns_once(cache, amx_machine, tmp_path):
    counter, path = tmp_path / "runs", gemma_path()
    with pytest.warns(RuntimeWarning) as caught:
        first = amx.decide(path, 1, argv=counting(counter, ["default"]))
    assert first.mode == "repack" and first.reason == "probed: default crashes, repack ok"
    (w,) = [w for w in caught if "#20824" in str(w.message)]
    text = str(w.message)
    for needed in ("llama.cpp #20824", "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16", "CFLAGS=", "CMAKE_ARGS=",
                   "CPU repacking kept", amx.ENV):
        assert needed in text, needed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second load: the cached verdicts, no child, no second warning
        assert amx.decide(path, 1, argv=counting(counter, ["default"])) == first
    assert runs(counter) == ["default", "repack"]


def test_a_crashing_repack_falls_back_to_no_extra_buffers(cache, amx_machine, tmp_path):
    counter = tmp_path / "runs"
    with pytest.warns(RuntimeWarning, match="and without CPU repacking"):
        decision = amx.decide(gemma_path(), 1, argv=counting(counter, ["default", "repack"]))
    assert decision.mode == "plain" and runs(counter) == ["default", "repack", "plain"]


def test_every_mode_crashing_is_a_load_error_not_a_dead_process(cache, amx_machine, tmp_path):
    with pytest.raises(ModelLoadError, match="every load mode"):
        amx.decide(gemma_path(), 1, argv=counting(tmp_path / "runs", bufts.MODES))


def test_the_environment_setting(cache, amx_machine, tmp_path, monkeypatch):
    counter = tmp_path / "runs"
    monkeypatch.setenv(amx.ENV, "on")
    assert amx.decide(gemma_path(), 1, argv=counting(counter, ["default"])).mode == "default"
    monkeypatch.setenv(amx.ENV, "OFF")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert amx.decide(gemma_path(), 1, argv=counting(counter, ["default"])).mode == "plain"
    assert runs(counter) == []  # neither probes
    monkeypatch.setenv(amx.ENV, "maybe")
    with pytest.raises(ModelLoadError, match="probe .*off or on"):
        amx.decide(gemma_path(), 1)


# -- the loader ------------------------------------------------------------------------------------------------
class LlamaLog:
    """llama.cpp's log lines while in use (llama-cpp-python's own callback is put back after)."""

    def __enter__(self):
        self.lines: list[str] = []
        self._cb = llama_cpp.llama_log_callback(lambda level, text, data: self.lines.append(text.decode(errors="replace")))
        llama_cpp.llama_log_set(self._cb, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc):
        from llama_cpp import _logger
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))

    def repack_mib(self) -> float | None:
        sizes = [float(m.group(1)) for m in re.finditer(r"CPU_REPACK model buffer size =\s*([\d.]+) MiB", "".join(self.lines))]
        return sizes[0] if sizes else None


def prefill_logits(model: LlamaCppModel, ids: list[int]) -> np.ndarray:
    L = lib()
    mark_decoded()  # (a decode outside continuum's own: ggml has now read GGML_CPU_TILED_MM)
    with model.lock:
        tokens = (L.llama_token * len(ids))(*ids)
        assert L.llama_decode(model.ctx, L.llama_batch_get_one(tokens, len(ids))) == 0
        out = L.llama_get_logits_ith(model.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(out, ctypes.POINTER(ctypes.c_float)), shape=(model.n_vocab,)).copy()


def test_the_loader_goes_around_amx_on_a_crash_verdict_and_keeps_repacking(cache, amx_machine, monkeypatch):
    """Verdicts as a probe leaves them (no child here) steer LlamaCppModel: default crashed -> the repack mode (no
    extra buffer types, the tensors llama.cpp repacks by default put in CPU_REPACK by name), warned once per process;
    repack crashed too -> plain. On this CPU (no AMX kernels in the build) the repack mode is exactly llama.cpp's
    default: the same repack buffer and bit-equal logits, unlike the plain mode."""
    path, ids = gemma_path(), [2, 818, 5279, 529, 7001, 563, 10243, 236761]
    key = amx._build_key(lib().llama_print_system_info().decode(), amx.cpu_amx_flags(),
                         sorted({k for _, _, k in bufts.gguf_tensors(path)} & bufts.AMX_TYPES))
    amx._write(cache, f"{key}/default", {"verdict": "crashes"})
    logits, repack = {}, {}
    # (verdict of the repack mode, the setting, the mode expected, warnings expected)
    cases = [("ok", "probe", "repack", 1), ("ok", "probe", "repack", 0), ("crashes", "probe", "plain", 0)]
    if not REAL_AMX:  # (with AMX kernels really here, the default mode may crash this process: #20824)
        cases.append(("crashes", "on", "default", 0))
    for repack_verdict, setting, mode, warned in cases:
        amx._write(cache, f"{key}/repack", {"verdict": repack_verdict})
        monkeypatch.setenv(amx.ENV, setting)
        with warnings.catch_warnings(record=True) as caught, LlamaLog() as log:
            warnings.simplefilter("always")
            model = LlamaCppModel(path, n_ctx=256, n_seq_max=1, n_batch=64, n_threads=2)
        assert model.load_mode == mode
        assert len([w for w in caught if "#20824" in str(w.message)]) == warned
        logits[mode], repack[mode] = prefill_logits(model, ids), log.repack_mib()
        model.close()
    assert repack["plain"] is None and repack["repack"] > 10
    assert not np.array_equal(logits["plain"], logits["repack"])  # (repacked kernels round differently)
    if not REAL_AMX:  # (where AMX kernels run, llama.cpp's default puts weights in the AMX buffer, not CPU_REPACK)
        assert repack["repack"] == repack["default"] and np.array_equal(logits["repack"], logits["default"])


def test_the_batch_invariant_mode_never_probes(cache, amx_machine, monkeypatch):
    def no_probe(*a, **k):
        raise AssertionError("probed")

    monkeypatch.setattr(amx, "verdict", no_probe)
    model = LlamaCppModel(gemma_path(), n_ctx=256, n_seq_max=1, n_batch=64, n_threads=2, batch_invariant=True)
    assert model.load_mode == "plain"
    model.close()


# -- the real thing ------------------------------------------------------------------------------------------
@pytest.mark.skipif(not amx.cpu_amx_flags(), reason="this CPU has no AMX (no amx_* flag in /proc/cpuinfo): the path "
                                                    "llama.cpp #20824 crashes cannot run here")
def test_gemma_loads_and_decodes_on_an_amx_cpu(cache):
    """On an AMX CPU: the real probe decides, the process survives a decode, and the verdict is cached."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = LlamaCppModel(gemma_path(), n_ctx=256, n_seq_max=1, n_batch=64, n_threads=2)
    logits = prefill_logits(model, [2, 818, 5279, 529, 7001, 563])
    assert np.isfinite(logits).all()
    said = [w for w in caught if "#20824" in str(w.message)]
    assert len(said) == (model.load_mode != "default")
    if amx.build_uses_amx(lib().llama_print_system_info().decode(), bufts.extra_bufts()):  # (probed: verdicts kept)
        verdicts = {k.split("/")[1]: v["verdict"] for k, v in json.loads(cache.read_text()).items()}
        assert verdicts[model.load_mode] == "ok"
        assert model.load_mode == "default" or verdicts["default"] in amx.UNSAFE
    else:
        assert model.load_mode == "default" and not cache.exists()
    model.close()
